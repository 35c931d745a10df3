"""Quantized models through the Bridge: same hook names, logits of the dequantized reference."""

from __future__ import annotations

import pytest
import torch
from dequantized_reference import dequantized_reference
from module_hooks import recording, replacing
from tiny_models import input_ids, make_model

from qlens.bridge import Bridge
from qlens.modules import QuantLinear
from qlens.modules.model_quantize import quantize

# One scheme per family, so every scheme runs through the bridge once.
CASES = [
    ("llama", "fp8-block"),
    ("qwen3", "mxfp8"),
    ("gpt2", "int4"),
    ("mixtral", "mxfp4"),
    ("qwen3_moe", "int8"),
    ("gpt_oss", "nvfp4"),
    ("qwen2_moe", "int4"),
    ("qwen2_moe", "nvfp4"),
]


@pytest.mark.parametrize(("family", "scheme"), CASES)
def test_quantized_bridge_keeps_every_hook_and_the_reference_logits(
    family: str, scheme: str
) -> None:
    model = make_model(family)
    bridge = Bridge(model)
    quantized = quantize(bridge, scheme)
    assert isinstance(quantized, Bridge) and quantized is not bridge
    assert quantized.model is not model
    assert any(isinstance(m, QuantLinear) for m in quantized.model.modules())
    assert quantized.hook_names == bridge.hook_names

    ids = input_ids()
    with torch.no_grad():
        logits, cache = quantized.run_with_cache(ids)
        _, float_cache = bridge.run_with_cache(ids)
        expected = dequantized_reference(model, quantized.model)(ids).logits
    assert set(cache.keys()) == set(float_cache.keys())
    assert len(cache.keys()) > 10 * model.config.num_hidden_layers
    for name in float_cache.keys():
        assert cache[name].shape == float_cache[name].shape, name
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)


def test_inplace_quantization_of_a_bridge_returns_a_working_bridge() -> None:
    bridge = Bridge(make_model("llama"))
    model = bridge.model
    quantized = quantize(bridge, "int8", inplace=True)
    assert quantized.model is model
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    with torch.no_grad():
        _, cache = quantized.run_with_cache(input_ids(), names_filter=lambda n: "mlp.hook_pre" in n)
    assert set(cache.keys()) == {
        f"blocks.{i}.mlp.{h}" for i in (0, 1) for h in ("hook_pre", "hook_pre_linear")
    }


def test_a_quantized_qwen2_moe_model_wraps_with_its_shared_expert_quantized() -> None:
    import qlens
    from qlens.modules import QuantExperts

    model = make_model("qwen2_moe")
    quantized = qlens.quantize(model, "int4")
    mlp = quantized.model.layers[0].mlp
    assert isinstance(mlp.experts, QuantExperts)
    shared = mlp.shared_expert
    for linear in (shared.gate_proj, shared.up_proj, shared.down_proj, mlp.shared_expert_gate):
        assert isinstance(linear, QuantLinear)
    reference = dequantized_reference(model, quantized)
    ids = input_ids()
    reference_mlp_out: list[torch.Tensor] = []
    handle = reference.model.layers[0].mlp.register_forward_hook(
        lambda _m, _i, out: reference_mlp_out.append(out)
    )
    try:
        with torch.no_grad():
            expected = reference(ids).logits
            logits, cache = Bridge(quantized).run_with_cache(
                ids, names_filter="blocks.0.hook_mlp_out"
            )
    finally:
        handle.remove()
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        cache["blocks.0.hook_mlp_out"], reference_mlp_out[0], atol=2e-5, rtol=1e-5
    )


def test_shared_expert_hooks_of_a_quantized_qwen2_moe_model_see_its_own_terms() -> None:
    """The hooks capture what the quantized modules compute, bit for bit (and, within the
    reference's rounding, the float model on the dequantized weights), and zeroing the shared
    term is the quantized model with its shared expert's output zeroed."""
    import qlens

    model = make_model("qwen2_moe")
    quantized = qlens.quantize(model, "int4")
    bridge, ids = Bridge(quantized), input_ids()
    routed_name, shared_name = "blocks.0.mlp.hook_routed_out", "blocks.0.mlp.hook_shared_expert_out"
    mlp = "model.layers.0.mlp"
    terms = [f"{mlp}.experts", f"{mlp}.shared_expert", f"{mlp}.shared_expert_gate"]
    with torch.no_grad():
        with recording(quantized, terms) as own:
            expected = quantized(ids).logits
        reference = dequantized_reference(model, quantized)
        with recording(reference, terms) as floats:
            reference(ids)
        logits, cache = bridge.run_with_cache(ids, names_filter=[routed_name, shared_name])
        zeroed = bridge.run_with_hooks(ids, fwd_hooks=[(shared_name, lambda x, h: 0 * x)])
        with replacing(quantized, {f"{mlp}.shared_expert": torch.zeros_like}):
            expected_zeroed = quantized(ids).logits
    assert torch.equal(logits, expected)
    gated = torch.sigmoid(own[f"{mlp}.shared_expert_gate"]) * own[f"{mlp}.shared_expert"]
    assert torch.equal(cache[shared_name], gated.reshape(*ids.shape, -1))
    assert torch.equal(cache[routed_name], own[f"{mlp}.experts"].reshape(*ids.shape, -1))
    assert torch.equal(zeroed, expected_zeroed) and not torch.equal(zeroed, logits)
    float_gated = (
        torch.sigmoid(floats[f"{mlp}.shared_expert_gate"]) * floats[f"{mlp}.shared_expert"]
    )
    torch.testing.assert_close(gated, float_gated, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        own[f"{mlp}.experts"], floats[f"{mlp}.experts"], atol=2e-5, rtol=1e-5
    )
