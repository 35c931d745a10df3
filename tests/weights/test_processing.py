"""Weight processing keeps the model's outputs, leaves the original alone and refuses
quantized weights unless dequantization is opted into."""

from __future__ import annotations

import logging

import pytest
import torch
from arch_models import ARCHS, perturbed_model, tiny_model
from fp8_experts import random_fp8_experts
from unreadable_models import swapped_bridge

from qlens.bridge import Bridge
from qlens.weights import accessors as A
from qlens.weights import dequantized, processing

TOKENS = torch.randint(3, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=5e-5, rtol=1e-5)


def _logits(bridge: Bridge, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return bridge(tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_processed_model_keeps_its_outputs(arch):
    bridge = Bridge(perturbed_model(arch))
    before = {n: p.detach().clone() for n, p in bridge.model.state_dict().items()}
    reference = _logits(bridge)
    folded = processing.fold_layer_norm(bridge)
    torch.testing.assert_close(_logits(folded.bridge), reference, **TOL)
    processed = processing.process_weights(bridge)
    with torch.no_grad():
        logits, cache = processed.bridge.run_with_cache(TOKENS)
    torch.testing.assert_close(logits.log_softmax(-1), reference.log_softmax(-1), **TOL)
    with torch.no_grad():
        _, original_cache = bridge.run_with_cache(TOKENS)
    assert set(cache.keys()) == set(original_cache.keys())  # every hook still fires
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], original_cache[
        "blocks.0.attn.hook_pattern"], **TOL)  # fmt: skip
    assert processed.summary.materialized == {}
    for name, value in bridge.model.state_dict().items():  # the original is untouched
        assert torch.equal(value, before[name]), name
    torch.testing.assert_close(_logits(bridge), reference, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "gemma", "phi3", "mixtral"])
def test_fold_layer_norm_leaves_identity_norms_and_scaled_readers(arch):
    bridge = Bridge(perturbed_model(arch))
    w_q = A.W_Q(bridge, 0).clone()
    norm_weight = bridge.model.get_submodule(bridge.adapter.layers)[0].get_submodule(
        bridge.adapter.layer.ln1
    ).weight.detach().clone()  # fmt: skip
    scale = norm_weight + bridge.cfg.norm_weight_offset
    folded = processing.fold_layer_norm(bridge).bridge
    expected = w_q * scale[None, :, None]
    if bridge.cfg.normalization_type == "LN":  # readers of a centered input are centered too
        expected = expected - expected.mean(1, keepdim=True)
    torch.testing.assert_close(A.W_Q(folded, 0), expected, **TOL)
    ln1 = folded.model.get_submodule(folded.adapter.layers)[0].get_submodule(
        folded.adapter.layer.ln1
    )
    assert torch.equal(ln1.weight, torch.full_like(ln1.weight, 1 - bridge.cfg.norm_weight_offset))


def test_fold_layer_norm_scales_the_shared_expert_and_its_gate():
    bridge = Bridge(perturbed_model("qwen2_moe"))
    ln2 = bridge.model.model.layers[0].post_attention_layernorm.weight.detach()
    readers = [(A.W_gate, "shared"), (A.W_in, "shared"), (A.W_in, 1)]  # and a routed expert
    before = [read(bridge, 0, expert=expert) for read, expert in readers]
    gate = A.W_shared_expert_gate(bridge, 0)
    folded = processing.fold_layer_norm(bridge).bridge
    for (read, expert), weight in zip(readers, before, strict=True):
        torch.testing.assert_close(read(folded, 0, expert=expert), weight * ln2[:, None], **TOL)
    torch.testing.assert_close(A.W_shared_expert_gate(folded, 0), gate * ln2, **TOL)
    shared_out = A.W_out(bridge, 0, expert="shared")
    assert torch.equal(A.W_out(folded, 0, expert="shared"), shared_out)  # it writes: unchanged
    with pytest.raises(ValueError, match="cannot center writing weights of a RMSNorm model"):
        processing.process_weights(bridge, center_writing_weights=True)


def test_centering_and_value_bias_folding():
    bridge = Bridge(perturbed_model("gpt2"))
    centered = processing.center_writing_weights(bridge).bridge
    assert torch.allclose(A.W_out(centered, 0).mean(-1), torch.zeros(1), atol=1e-6)
    assert torch.allclose(A.W_E(centered).mean(-1), torch.zeros(1), atol=1e-6)
    unembed = processing.center_unembed(bridge).bridge
    assert torch.allclose(A.W_U(unembed).mean(-1), torch.zeros(1), atol=1e-6)
    folded = processing.fold_value_biases(bridge).bridge
    assert torch.equal(A.b_V(folded), torch.zeros_like(A.b_V(folded)))
    expected = A.b_O(bridge, 1) + torch.einsum("hd,hdm->m", A.b_V(bridge, 1), A.W_O(bridge, 1))
    torch.testing.assert_close(A.b_O(folded, 1), expected, **TOL)
    torch.testing.assert_close(_logits(folded), _logits(bridge), **TOL)


def test_invalid_processing_is_refused():
    with pytest.raises(ValueError, match="cannot center writing weights of a RMSNorm model"):
        processing.center_writing_weights(Bridge(tiny_model("llama")))
    with pytest.raises(ValueError, match="attention sinks take part of the softmax mass"):
        processing.fold_value_biases(Bridge(tiny_model("gpt_oss")))


def test_value_biases_of_attention_with_sinks_are_not_foldable():
    bridge = Bridge(perturbed_model("gpt_oss"))
    message = r"contributes \(1 - p_sink\) \* b_V @ W_O at each position"
    with pytest.raises(ValueError, match=message):
        processing.fold_value_biases(bridge)
    forced = processing.fold_layer_norm(bridge).bridge  # a processable copy
    reference = _logits(forced)
    processing._fold_value_biases(forced)  # what the refusal prevents
    assert not torch.allclose(_logits(forced), reference, atol=1e-3)
    processed = processing.process_weights(bridge)  # every other step applies
    assert processed.summary.steps == ["fold_layer_norm", "center_unembed"]
    torch.testing.assert_close(
        _logits(processed.bridge).log_softmax(-1), _logits(bridge).log_softmax(-1), **TOL
    )


def test_inplace_processes_the_given_model():
    bridge = Bridge(perturbed_model("llama"))
    result = processing.fold_layer_norm(bridge, inplace=True)
    assert result.bridge.model is bridge.model


def test_opt_in_materializes_quantized_layers_and_reports_memory(caplog):
    bridge = swapped_bridge("qlens_payload")
    tokens = TOKENS % bridge.cfg.d_vocab
    reference = _logits(bridge, tokens)
    with caplog.at_level(logging.WARNING, logger="qlens.weights.materialize"):
        result = processing.process_weights(bridge, dequantize=True)
    summary = result.summary
    assert len(summary.materialized) == 8  # q k v o gate up down lm_head
    assert summary.materialized["model.layers.0.mlp.down_proj"] == 128 * 256 * 4
    assert summary.materialized_bytes == sum(summary.materialized.values())
    assert "materialized 8 quantized weights as float32" in str(summary)
    announced = f"materializing 8 quantized weights as float32 ({summary.materialized_bytes / 2**20:.2f} MiB)"
    assert announced in caplog.text  # announced before materializing, with the same total
    logits = _logits(result.bridge, tokens)
    torch.testing.assert_close(logits.log_softmax(-1), reference.log_softmax(-1), **TOL)
    with dequantized(bridge):  # the bridge-level opt-in works too
        folded = processing.fold_layer_norm(bridge)
    assert folded.summary.materialized == summary.materialized


def test_scans_three_dimensional_experts():
    model = perturbed_model("mixtral")
    experts = model.model.layers[1].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(
        experts.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    bridge = Bridge(model)
    message = r"first: model\.layers\.1\.mlp\.experts\.gate_up_proj\) because the weight has 1-byte"
    with pytest.raises(NotImplementedError, match=message):
        processing.fold_layer_norm(bridge)
    with pytest.raises(NotImplementedError, match="no dequantizer for a torch"):
        processing.fold_layer_norm(bridge, dequantize=True)
    with pytest.raises(NotImplementedError, match=r"read the experts of layer 1"):
        A.W_in(bridge, 1)


@pytest.mark.parametrize(
    ("arch", "scheme"),
    [("mixtral", "int8"), ("qwen3_moe", "mxfp4"), ("gpt_oss", "mxfp4"), ("qwen2_moe", "int8")],
)
def test_opt_in_rebuilds_quantized_experts_as_the_family_float_class(arch, scheme):
    from qlens.modules import QuantExperts
    from qlens.modules.model_quantize import quantize

    float_model = perturbed_model(arch)
    options = {"group_size": 32} if scheme == "int8" else {}
    quantized = quantize(Bridge(float_model), scheme, **options)
    with pytest.raises(NotImplementedError, match=rf"\(quantization: qlens {scheme} payload"):
        processing.fold_layer_norm(quantized)
    tokens = TOKENS % quantized.cfg.d_vocab
    reference = _logits(quantized, tokens)
    result = processing.process_weights(quantized, dequantize=True)
    logits = _logits(result.bridge, tokens)
    torch.testing.assert_close(logits.log_softmax(-1), reference.log_softmax(-1), **TOL)
    config = float_model.config
    n_experts = getattr(config, "num_local_experts", None) or config.num_experts
    d_mlp = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    expected_bytes = 3 * n_experts * config.hidden_size * d_mlp * 4  # gate, up, down in fp32
    for layer in range(config.num_hidden_layers):
        if layer in getattr(config, "mlp_only_layers", []):
            continue  # a dense layer (Qwen2-MoE layer 1)
        name = f"model.layers.{layer}.mlp.experts"
        assert result.summary.materialized[name] == expected_bytes, name
        rebuilt = result.bridge.model.get_submodule(name)
        assert type(rebuilt) is type(float_model.get_submodule(name))  # the HF float class
        assert isinstance(quantized.model.get_submodule(name), QuantExperts)  # original kept
    assert f"{name}: {expected_bytes / 2**20:.3f} MiB" in str(result.summary)
    if arch == "qwen2_moe":  # the shared expert and its gate are float nn.Linear again
        for part in ("shared_expert.gate_proj", "shared_expert.down_proj", "shared_expert_gate"):
            rebuilt = result.bridge.model.get_submodule(f"model.layers.0.mlp.{part}")
            assert type(rebuilt) is torch.nn.Linear, part
    steps = ["fold_layer_norm", "center_unembed"]
    assert result.summary.steps == steps + ([] if arch == "gpt_oss" else ["fold_value_biases"])


def test_opt_in_rebuilds_transformers_fp8_experts_as_float():
    model = perturbed_model("mixtral")
    float_class = type(model.model.layers[0].mlp.experts)
    experts = random_fp8_experts(model.config, (16, 16), seed=3)
    model.model.layers[0].mlp.experts = experts
    bridge = Bridge(model)  # runs the FP8 experts through qlens on this CPU
    reference = _logits(bridge)
    result = processing.process_weights(bridge, dequantize=True)
    torch.testing.assert_close(
        _logits(result.bridge).log_softmax(-1), reference.log_softmax(-1), **TOL
    )
    name = "model.layers.0.mlp.experts"
    assert type(result.bridge.model.get_submodule(name)) is float_class
    config = model.config
    expected = 3 * config.num_local_experts * config.hidden_size * config.intermediate_size * 4
    assert result.summary.materialized == {name: expected}
