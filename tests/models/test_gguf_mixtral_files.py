"""`qlens.load` on Mixtral GGUF files written by gguf-py as llama.cpp writes them (architecture
``llama`` with ``llama.expert_count`` > 0, stacked ``blk.N.ffn_{gate,up,down}_exps`` experts, a
float router): the experts stay GGUF blocks in ``QuantExperts`` that decode to exactly gguf-py's
values, and the model predicts like a float ``MixtralForCausalLM`` holding gguf-py's values
(transformers reads these files as dense Llamas, so it is no oracle here)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    float_mixtral,
    gguf_py_values,
    make_gguf_mixtral,
    permute_rows,
    write_gguf_llama,
)
from gguf_moe_files import (  # noqa: E402
    assert_expert_reads_are_guarded,
    assert_experts_are_the_files_blocks,
    assert_holds_the_weights_of,
    assert_reloads_with_the_same_gguf_experts,
    moe_block_outputs,
    moe_type_of,
)
from model_fixtures import make_tiny_tokenizer  # noqa: E402
from transformers import MixtralConfig  # noqa: E402

import qlens  # noqa: E402
from qlens.modules import QuantExperts, QuantLinear  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402

N_LAYERS, N_HEADS, N_KV_HEADS, N_EXPERTS = 2, 4, 2, 4
# One type everywhere, or llama.cpp's Q4_K_M-like mix (gguf_moe_files.MIXED).
KINDS = ("Q8_0", "Q4_0", "Q4_K", "mixed")
TOKENS = torch.tensor([[3, 17, 42, 8, 63, 5, 29]])
ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf_mixtral")
    model = make_gguf_mixtral()
    return {k: write_gguf_llama(model, folder / f"tiny-{k}.gguf", moe_type_of(k)) for k in KINDS}


@pytest.fixture(scope="module")
def bridges(files) -> dict[str, qlens.Bridge]:
    return {kind: qlens.load(path, tokenizer=make_tiny_tokenizer()) for kind, path in files.items()}


def test_config_comes_from_the_llama_metadata(bridges, tmp_path):
    written = make_gguf_mixtral().config
    config = bridges["Q8_0"].model.config
    assert type(config) is MixtralConfig
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "num_local_experts",
        "num_experts_per_tok", "max_position_embeddings", "tie_word_embeddings", "hidden_act",
    ):  # fmt: skip
        assert getattr(config, field) == getattr(written, field), field
    assert config.head_dim == 64 and config.rope_parameters["rope_theta"] == 10000.0
    assert config.rms_norm_eps == float(np.float32(written.rms_norm_eps))  # stored as float32
    # the counts are the file's: another file with 3 experts, 1 per token
    other = make_gguf_mixtral(experts=3, top_k=1)
    path = write_gguf_llama(other, tmp_path / "three.gguf", lambda _: "Q8_0")
    model = qlens.load(path, tokenizer=make_tiny_tokenizer()).model
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (3, 1)
    assert model.model.layers[1].mlp.experts.num_experts == 3


@pytest.mark.parametrize("kind", KINDS)
def test_experts_stay_gguf_blocks_that_decode_to_gguf_py_values(files, bridges, kind):
    path = files[kind]
    reader = gguf.GGUFReader(str(path))
    expected = gguf_py_values(reader)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    model = bridges[kind].model
    assert not [n for n, p in model.named_parameters() if p.ndim == 3]  # no float experts
    for index, layer in enumerate(model.model.layers):
        blk = f"blk.{index}"
        assert_experts_are_the_files_blocks(layer.mlp.experts, index, types, expected, N_EXPERTS)
        # attention stays packed, q/k rows in HF order; the router is float, as in the file
        attn = layer.self_attn
        assert all(isinstance(attn.get_submodule(n), QuantLinear) for n in ("v_proj", "o_proj"))
        for name, heads in (("q_proj", N_HEADS), ("k_proj", N_KV_HEADS)):
            rows = permute_rows(qlens.dequantize(attn.get_submodule(name)).numpy(), heads)
            np.testing.assert_array_equal(rows, expected[f"{blk}.{ATTENTION[name]}.weight"])
        router = layer.mlp.gate.weight.detach()
        assert router.dtype == torch.float32
        np.testing.assert_array_equal(router.numpy(), expected[f"{blk}.ffn_gate_inp.weight"])
    formats = sorted({f"gguf_{t.lower()}" for t in types.values() if t not in ("F32", "F16")})
    assert audit_weights(model).formats == formats


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_a_float_mixtral_of_gguf_py_values(files, bridges, kind):
    bridge = bridges[kind]
    reference = float_mixtral(files[kind], bridge.model.config)
    floats = dict(reference.named_parameters())
    for name, tensor in bridge.model.named_parameters():  # embeddings, norms, routers
        assert torch.equal(tensor, floats[name]), name
    with torch.no_grad():
        ours, theirs = bridge(TOKENS), reference(TOKENS).logits
    # Identical float32 weights and float routers, so both pick the same experts; the paths
    # differ only in matmul summation order (qlens dequantizes each linear and each hit expert,
    # then matmuls), a few ulps per dot product of <= 512 terms, through two layers.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())


def test_hooks_fire_on_router_and_experts(files, bridges):
    bridge = bridges["Q4_K"]
    seen = moe_block_outputs(float_mixtral(files["Q4_K"], bridge.model.config), 1, TOKENS)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS)
    logits, scores, indices = seen["router"]
    tolerance = {"rtol": 0, "atol": 1e-5 * logits.abs().max().item()}  # as in the logits test
    router_logits = cache["blocks.1.mlp.hook_router_logits"]
    torch.testing.assert_close(router_logits.reshape(logits.shape), logits, **tolerance)
    dense = torch.zeros(logits.shape).scatter(1, indices, scores)  # [tokens, experts]
    router_weights = cache["blocks.1.mlp.hook_router_weights"]
    assert router_weights.shape == (1, TOKENS.shape[1], N_EXPERTS)
    assert torch.equal(router_weights.reshape(dense.shape) != 0, dense != 0)  # same experts
    torch.testing.assert_close(router_weights.reshape(dense.shape), dense, rtol=0, atol=1e-6)
    mlp_out, scale = cache["blocks.1.hook_mlp_out"], seen["mlp"].abs().max().item()
    torch.testing.assert_close(mlp_out, seen["mlp"], rtol=0, atol=1e-5 * scale)
    # a hook on the router weights reaches the packed experts: zeroed weights, zero output
    zeroed = [("blocks.1.mlp.hook_router_weights", lambda weights, hook: weights * 0)]
    with torch.no_grad(), bridge.hooks(fwd_hooks=zeroed):
        _, ablated = bridge.run_with_cache(TOKENS, names_filter="blocks.1.hook_mlp_out")
    assert torch.equal(ablated["blocks.1.hook_mlp_out"], torch.zeros_like(seen["mlp"]))


def test_expert_weight_reads_are_guarded(files, bridges):
    bridge = bridges["Q4_K"]
    reference = float_mixtral(files["Q4_K"], bridge.model.config).model.layers[0].mlp.experts
    assert_expert_reads_are_guarded(bridge, reference, "gguf_q4_k", expert=2)


def test_dequantize_on_load_gives_the_float_mixtral(files, bridges):
    path = files["mixed"]
    floats = qlens.load(path, dequantize=True, tokenizer=make_tiny_tokenizer())
    assert not any(isinstance(m, (QuantExperts, QuantLinear)) for m in floats.model.modules())
    assert type(floats.model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    reference = float_mixtral(path, floats.model.config)
    expected = dict(reference.named_parameters())
    assert sorted(n for n, _ in floats.model.named_parameters()) == sorted(expected)
    for name, tensor in floats.model.named_parameters():
        assert torch.equal(tensor, expected[name]), name
    with torch.no_grad():
        ours, packed = floats(TOKENS), bridges["mixed"](TOKENS)
    torch.testing.assert_close(ours, packed, rtol=0, atol=1e-5 * packed.abs().max().item())


def test_bfloat16_load_rounds_gguf_py_values(files):
    path = files["mixed"]
    model = qlens.load(path, dtype=torch.bfloat16, tokenizer=make_tiny_tokenizer()).model
    assert_holds_the_weights_of(model, float_mixtral(path, model.config).to(torch.bfloat16))


def test_saved_mixtral_reloads_with_the_same_gguf_experts(bridges, tmp_path):
    reloaded = assert_reloads_with_the_same_gguf_experts(bridges["Q4_K"], tmp_path, TOKENS)
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    assert reloaded.config.num_experts_per_tok == 2


def test_experts_whose_gate_and_up_differ_load_as_gguf_py_floats(tmp_path, caplog):
    types = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"}
    path = write_gguf_llama(
        make_gguf_mixtral(),
        tmp_path / "split.gguf",
        lambda name: types.get(name.split(".")[-2], "Q8_0"),
    )
    with caplog.at_level(logging.WARNING, logger="qlens.gguf_experts"):
        bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    assert "blk.1.ffn_up_exps.weight Q4_0" in caplog.text
    experts = bridge.model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "MixtralExperts"
    reference = float_mixtral(path, bridge.model.config)
    floats = dict(reference.named_parameters())
    for name, tensor in bridge.model.named_parameters():  # experts included, now float
        assert torch.equal(tensor, floats[name]), name
    with torch.no_grad():
        ours, theirs = bridge(TOKENS), reference(TOKENS).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())


# write kwargs, model kwargs, the error
BROKEN = {
    "no-up": (
        {"omit": ("blk.1.ffn_up_exps.weight",)},
        {},
        r"broken\.gguf lacks blk\.1\.ffn_up_exps\.weight \(the layer's other expert tensors",
    ),
    "no-experts": (
        {"omit": tuple(f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))},
        {},
        r"broken\.gguf lacks tensors for model\.layers\.1\.mlp\.experts\.down_proj, "
        r"model\.layers\.1\.mlp\.experts\.gate_up_proj",
    ),
    "fewer-experts-than-the-count": (
        {"experts_written": 3},
        {},
        r"broken\.gguf: blk\.0\.ffn_gate_exps\.weight has shape \[3, 512, 256\] \[experts, out, "
        r"in\], but .* expects \[4, 512, 256\] at model\.layers\.0\.mlp\.experts "
        r"\(num_local_experts=4, intermediate_size=512, hidden_size=256\): the file does not "
        r"match its own metadata",
    ),
    "count-larger-than-the-router": (
        {"expert_count": 8},
        {},
        r"broken\.gguf: blk\.0\.ffn_gate_inp\.weight holds a \[4, 256\] weight, but "
        r"model\.layers\.0\.mlp\.gate\.weight .* is \[8, 256\]",
    ),
    "more-used-than-experts": (
        {"expert_count": 1},
        {},
        r"broken\.gguf is a Mixtral file \(llama\.expert_count=1\) whose "
        r"llama\.expert_used_count is 2; it must name how many experts route each token",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_mixtral_files_raise_naming_what_is_wrong(tmp_path, case):
    write_kwargs, model_kwargs, error = BROKEN[case]
    path = write_gguf_llama(
        make_gguf_mixtral(**model_kwargs), tmp_path / "broken.gguf", lambda _: "Q8_0",
        **write_kwargs,
    )  # fmt: skip
    with pytest.raises(ValueError, match=error):
        qlens.load(path, tokenizer=make_tiny_tokenizer())
