"""qlens.quantize on tiny random models: every scheme, dense and MoE families."""

from __future__ import annotations

import logging

import pytest
import torch
from dequantized_reference import dequantized_reference
from tiny_models import input_ids, make_model
from torch import nn

from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.model_quantize import DEFAULT_SKIP, SCHEMES, quantize

FAMILIES = ["llama", "qwen3", "gpt2", "mixtral", "qwen3_moe", "gpt_oss"]
# The reference runs the same fp32 math on the same dequantized weights; only summation order
# (expert accumulation) may differ.
TOLERANCE = dict(atol=2e-5, rtol=1e-5)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _linear_like(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_logits_match_dequantized_reference(family: str, scheme: str) -> None:
    model = make_model(family)
    quantized = quantize(model, scheme)
    ids = input_ids()
    got = _logits(quantized, ids)
    torch.testing.assert_close(
        got, _logits(dequantized_reference(model, quantized), ids), **TOLERANCE
    )
    # The weights really changed: the quantized logits are not the float ones.
    assert (got - _logits(model, ids)).abs().max() > 1e-4
    # Every linear layer but the unembedding was swapped, and every experts module.
    assert _linear_like(quantized) == ["lm_head"]
    experts = [m for m in quantized.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == (1 if family in ("mixtral", "qwen3_moe", "gpt_oss") else 0)
    # Contiguous payloads (the kernels' layout), also for GPT-2's transposed Conv1D weights.
    for module in quantized.modules():
        if isinstance(module, (QuantLinear, QuantExperts)):
            for spec in module.payload_specs():
                payload = module.payload_for(spec)
                assert all(t.is_contiguous() for t in payload.tensors().values())


@pytest.mark.parametrize(("family", "skip"), [("llama", None), ("gpt2", []), ("gpt_oss", None)])
def test_returns_a_copy_and_leaves_the_input_untouched(family: str, skip: list[str] | None) -> None:
    # gpt2 with skip=[]: lm_head (tied to the kept embedding) is quantized too
    model = make_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize(model, "int8", skip=skip)
    assert quantized is not model
    assert not any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    original = {t.data_ptr() for t in model.state_dict().values()}
    assert original.isdisjoint(t.data_ptr() for t in quantized.state_dict().values())


def test_inplace_swaps_inside_the_given_model() -> None:
    model = make_model("mixtral")
    result = quantize(model, "mxfp4", inplace=True)
    assert result is model
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)


def test_skip_patterns_replace_the_defaults() -> None:
    model = make_model("llama")
    kept = quantize(model, "int8", skip=[*DEFAULT_SKIP, "*.q_proj"])
    assert isinstance(kept.model.layers[1].self_attn.q_proj, nn.Linear)
    assert isinstance(kept.model.layers[1].self_attn.k_proj, QuantLinear)
    everything = quantize(model, "int8", skip=[])
    assert isinstance(everything.lm_head, QuantLinear)


def test_int_group_size_is_selectable() -> None:
    quantized = quantize(make_model("qwen3"), "int4", group_size=64)
    payload = quantized.model.layers[0].mlp.down_proj.payload
    assert payload.format.block == (1, 64)
    assert tuple(payload.scales.shape) == (128, 256 // 64)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("int4", {"asymmetric": True, "group_size": 32}), ("fp8-block", {"scale_dtype": "e8m0"})],
)
def test_quantizer_options_reach_every_layer(scheme: str, options: dict) -> None:
    model = make_model("mixtral")
    quantized = quantize(model, scheme, **options)
    for module in quantized.modules():
        if isinstance(module, (QuantLinear, QuantExperts)):
            for prefix in module.payload_specs():
                fmt = module.payload_for(prefix).format
                if options.get("asymmetric"):
                    assert fmt.zero_point == "int" and fmt.block == (1, 32)
                else:
                    assert fmt.scale_dtype == "e8m0"
    ids = input_ids()
    expected = _logits(dequantized_reference(model, quantized), ids)
    torch.testing.assert_close(_logits(quantized, ids), expected, **TOLERANCE)


def test_logs_what_was_swapped_and_what_was_kept(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="qlens.modules.model_quantize"):
        quantize(make_model("gpt2"), "fp8-block")
    text = caplog.text
    assert "quantized transformer.h.0.attn.c_attn (conv1d)" in text
    assert "kept lm_head unquantized: matches skip pattern 'lm_head'" in text
    assert "swapped 4 modules" in text


def test_bad_arguments_raise_with_the_fix() -> None:
    model = make_model("qwen3")
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'fp4'.*'mxfp4'"):
        quantize(model, "fp4")
    with pytest.raises(ValueError, match="group_size applies to the int4/int8 schemes only"):
        quantize(model, "fp8-block", group_size=64)
    with pytest.raises(ValueError, match="asymmetric=True applies to int4/int8 only"):
        quantize(model, "mxfp4", asymmetric=True)
    with pytest.raises(TypeError, match="expects an nn.Module or a qlens Bridge"):
        quantize(object(), "int8")


def test_quantizer_rejection_names_the_module() -> None:
    model = make_model("qwen3")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.up_proj .*skip="):
        quantize(model, "int8")


def test_dtype_casts_keep_payloads_exact() -> None:
    quantized = quantize(make_model("llama"), "fp8-block")
    layer = quantized.model.layers[0].self_attn.q_proj
    data, scales = layer.payload.data.clone(), layer.payload.scales.clone()
    quantized.to(torch.bfloat16)
    assert layer.payload.data.dtype == torch.float8_e4m3fn and torch.equal(
        layer.payload.data.view(torch.uint8), data.view(torch.uint8)
    )
    assert layer.payload.scales.dtype == torch.float32 and torch.equal(layer.payload.scales, scales)
    assert quantized.model.embed_tokens.weight.dtype == torch.bfloat16
    assert _logits(quantized, input_ids()).dtype == torch.bfloat16


def test_experts_with_unknown_gating_are_kept_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = make_model("mixtral")
    experts = model.model.layers[0].mlp.experts

    class SquaredGateExperts(type(experts)):
        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return gate.square() * up

    experts.__class__ = SquaredGateExperts
    with caplog.at_level(logging.INFO, logger="qlens.modules.model_quantize"):
        quantized = quantize(model, "int8")
    assert isinstance(quantized.model.layers[0].mlp.experts, SquaredGateExperts)
    assert "SquaredGateExperts._apply_gate) is not one qlens reproduces" in caplog.text
