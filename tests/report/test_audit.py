"""The quantization audit against independent measures of the model's storage."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.finegrained_fp8 import FP8Linear

import qlens
from qlens.report.audit import audit_weights
from qlens.report.audit_section import grouped_rows, weight_kind


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's state dict, each storage counted once (tied weights share one)."""
    seen = {}
    for tensor in model.state_dict().values():
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("tied", [True, False])
def test_float_model_every_weight_readable_ratio_one(tied):
    model = tiny_llama(tied)
    audit = audit_weights(model)
    parameters = dict(model.named_parameters())  # tied parameters listed once
    assert [row.name for row in audit.rows] == list(parameters)
    assert all(row.readable and row.reason is None for row in audit.rows)
    assert all(row.format == "float32" and row.bits_per_weight == 32.0 for row in audit.rows)
    totals = audit.totals()
    assert totals["bytes"] == state_bytes(model) == sum(r.bytes for r in audit.rows)
    assert totals["elements"] == sum(p.numel() for p in parameters.values())
    assert totals["compression_ratio"] == 1.0
    assert (totals["readable"], totals["unreadable"], totals["formats"]) == (len(parameters), 0, [])


@pytest.mark.parametrize(("scheme", "format_name"), [("int4", "int4_g128"), ("mxfp4", "mxfp4")])
def test_quantized_copy_rows_are_its_payloads(scheme, format_name):
    model = qlens.quantize(tiny_llama(tied=False), scheme)
    audit = audit_weights(model)
    rows = {row.name: row for row in audit.rows}
    q_proj = rows["model.layers.0.self_attn.q_proj.weight"]
    assert not q_proj.readable
    assert "integer dtype torch.uint8" in q_proj.reason
    assert q_proj.format.startswith(format_name.split("_")[0])
    assert q_proj.shape == [64, 64] and q_proj.elements == 64 * 64
    if scheme == "mxfp4":  # 4 bits per element plus one 8-bit scale per 32 elements
        assert q_proj.bits_per_weight == 4 + 8 / 32
        assert q_proj.bytes == 64 * 64 // 2 + 64 * 64 // 32
    assert rows["lm_head.weight"].readable  # skipped by qlens.quantize
    assert rows["model.norm.weight"].readable
    totals = audit.totals()
    assert totals["bytes"] == state_bytes(model)
    assert totals["unreadable"] == 2 * 7  # every linear layer of both blocks
    assert totals["compression_ratio"] == pytest.approx(totals["elements"] * 4 / state_bytes(model))
    assert totals["compression_ratio"] > 1.5


def test_library_fp8_module_is_one_weight_with_its_scales():
    model = tiny_llama(tied=False)
    fp8 = FP8Linear(64, 96, block_size=(32, 32), has_bias=True)
    with torch.no_grad():
        fp8.weight.copy_((torch.randn(96, 64) * 50).to(torch.float8_e4m3fn))
        fp8.weight_scale_inv.copy_(torch.rand(fp8.weight_scale_inv.shape) + 0.1)
        fp8.bias.copy_(torch.randn(96))  # transformers leaves it uninitialised
    model.model.layers[1].mlp.up_proj = fp8
    audit = audit_weights(model)
    rows = {row.name: row for row in audit.rows}
    assert "model.layers.1.mlp.up_proj.weight_scale_inv" not in rows
    row = rows["model.layers.1.mlp.up_proj.weight"]
    assert (row.readable, row.format, row.shape) == (False, "fp8_block", [96, 64])
    stored = fp8.weight.numel() + fp8.weight_scale_inv.numel() * 4  # e4m3 + fp32 per 32x32
    assert row.bytes == stored
    assert row.bits_per_weight == 8 * stored / (96 * 64)
    assert "1-byte float dtype" in row.reason
    assert rows["model.layers.1.mlp.up_proj.bias"].readable
    assert audit.totals()["bytes"] == state_bytes(model)
    assert audit.formats == ["fp8_block"]


def test_meta_weights_are_unreadable_with_the_reason():
    with torch.device("meta"):
        model = tiny_llama()
    audit = audit_weights(model)
    assert audit.rows and not any(row.readable for row in audit.rows)
    assert all("meta device" in row.reason for row in audit.rows)


def test_grouping_by_kind_sums_rows():
    audit = audit_weights(qlens.quantize(tiny_llama(), "int8"))
    assert weight_kind("model.layers.12.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"
    groups = grouped_rows(audit.rows)
    assert sum(g["count"] for g in groups) == len(audit.rows)
    assert sum(g["bytes"] for g in groups) == audit.total_bytes
    up = next(g for g in groups if g["kind"] == "model.layers.*.mlp.up_proj.weight")
    assert (up["count"], up["readable"]) == (2, False)


def test_tied_unreadable_weight_is_listed_once():
    model = tiny_llama(tied=True)
    fp8 = torch.nn.Parameter(torch.randn(96, 64).to(torch.float8_e4m3fn), requires_grad=False)
    model.model.embed_tokens.weight = fp8
    model.lm_head.weight = fp8
    rows = [row for row in audit_weights(model).rows if not row.readable]
    assert [(row.name, row.format, row.bytes) for row in rows] == [
        ("model.embed_tokens.weight", "float8_e4m3fn", 96 * 64)
    ]
    assert "1-byte float dtype" in rows[0].reason
