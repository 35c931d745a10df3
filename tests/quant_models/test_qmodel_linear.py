"""QuantLinear: forward against the dequantized weight, buffers, dtype/device moves, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qlens.modules import QuantLinear
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

SCHEMES = ["fp8-block", "mxfp8", "mxfp4", "nvfp4", "int4", "int8"]


def _weight(n: int = 96, k: int = 160, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("scheme", SCHEMES)
def test_forward_is_the_matmul_with_the_dequantized_weight(scheme: str) -> None:
    payload = quantize_weight(_weight(), scheme)  # ragged: 96 x 160 fits no 128 block exactly
    bias = torch.randn(96)
    layer = QuantLinear(payload, bias)
    x = torch.randn(2, 3, 160)
    expected = F.linear(x, dequantize(payload, torch.float32), bias)
    assert torch.equal(layer(x), expected)


def test_weight_attribute_points_at_dequantize() -> None:
    layer = QuantLinear(quantize_weight(_weight(), "int4"))
    with pytest.raises(AttributeError, match=r"no `\.weight`.*qlens\.dequantize\(module\)"):
        _ = layer.weight
    assert not hasattr(layer, "weight")
    assert layer.bias is None


def test_repr_names_format_shape_and_bits() -> None:
    layer = QuantLinear(quantize_weight(_weight(), "mxfp4"), torch.zeros(96))
    text = repr(layer)
    bits = layer.payload.bits_per_weight
    assert text == (
        "QuantLinear(in_features=160, out_features=96, bias=True, format=mxfp4, block=(1, 32), "
        f"{bits:.2f} bits/weight)"
    )
    assert 4.0 < bits < 4.5


def test_payload_tensors_are_buffers_in_the_state_dict() -> None:
    payload = quantize_weight(_weight(), "nvfp4")
    layer = QuantLinear(payload, torch.ones(96))
    state = layer.state_dict()
    assert set(state) == {"weight_data", "weight_scales", "weight_global_scale", "bias"}
    assert state["weight_data"].data_ptr() == payload.data.data_ptr()
    assert layer.payload.global_scale is payload.global_scale


def test_dtype_cast_moves_bias_but_never_payloads() -> None:
    layer = QuantLinear(quantize_weight(_weight(), "fp8-block"), torch.randn(96))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    for name in ("weight_data", "weight_scales"):
        tensor = getattr(layer, name)
        assert tensor.dtype == before[name].dtype
        assert torch.equal(tensor.view(torch.uint8), before[name].view(torch.uint8))
    x = torch.randn(4, 160, dtype=torch.bfloat16)
    # computed in fp32 on the exact weight, rounded once to the input's dtype
    expected = F.linear(x.float(), dequantize(layer.payload), layer.bias.float())
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected.to(torch.bfloat16))


def test_device_moves_take_every_payload_tensor() -> None:
    layer = QuantLinear(quantize_weight(_weight(), "int4", asymmetric=True), torch.randn(96))
    layer.to("meta")
    payload = layer.payload
    assert all(t.is_meta for t in payload.tensors().values())
    assert payload.zeros is not None and payload.zeros.dtype == torch.uint8
    with pytest.raises(RuntimeError, match=r"input is on cpu but its quantized weight is on meta"):
        layer(torch.randn(2, 160))


def test_bad_shapes_raise_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"needs a 2-D \[out, in\] payload.*QuantExperts"):
        QuantLinear(quantize_weight(torch.randn(2, 32, 32), "int8"))
    with pytest.raises(ValueError, match=r"bias has shape \[95\].*shape \[96\]"):
        QuantLinear(quantize_weight(_weight(), "int8"), torch.zeros(95))
    layer = QuantLinear(quantize_weight(_weight(), "int8"))
    with pytest.raises(ValueError, match=r"expects inputs with 160 features.*\[2, 159\]"):
        layer(torch.randn(2, 159))


def test_gradients_flow_to_the_input() -> None:
    # Attribution methods backpropagate through quantized layers to activations.
    payload = quantize_weight(_weight(), "mxfp4")
    layer = QuantLinear(payload, torch.randn(96))
    x = torch.randn(4, 160, requires_grad=True)
    layer(x).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    F.linear(x_ref, dequantize(payload), layer.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
