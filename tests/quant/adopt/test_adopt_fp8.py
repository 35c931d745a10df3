"""Adopting transformers FP8Linear / FP8Experts (built on CPU with random e4m3 weights and
scales) against transformers' own dequantization helper ``_dequantize_fp8_weight``."""

import pytest
import torch
from transformers import MixtralConfig
from transformers.integrations import finegrained_fp8 as hf_fp8

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.registry import dequantizer_for


def _random_fp8(shape, gen):
    return (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


def _fill(weight, scale, gen):
    with torch.no_grad():
        weight.copy_(_random_fp8(weight.shape, gen))
        if scale.dtype == torch.float8_e8m0fnu:
            codes = torch.randint(100, 140, scale.shape, generator=gen).to(torch.uint8)
            scale.copy_(codes.view(torch.float8_e8m0fnu))
        else:
            scale.copy_(torch.rand(scale.shape, generator=gen) + 0.01)


def _dequantize(payload):
    return dequantizer_for(payload.format.name)(payload, torch.float32)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_linear_ragged_blocks(scale_fmt):
    gen = torch.Generator().manual_seed(0)
    # 70 x 100 with 32 x 32 blocks: partial last block in both directions.
    module = hf_fp8.FP8Linear(100, 70, block_size=(32, 32), scale_fmt=scale_fmt)
    _fill(module.weight, module.weight_scale_inv, gen)
    before = module.weight.view(torch.uint8).clone()
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == "fp8_block" and payload.format.block == (32, 32)
    assert payload.format.scale_dtype == ("e8m0" if scale_fmt == "ue8m0" else "fp32")
    expected = hf_fp8._dequantize_fp8_weight(
        module.weight, module.weight_scale_inv, [32, 32], torch.float32
    )
    assert torch.equal(_dequantize(payload), expected)
    assert torch.equal(module.weight.view(torch.uint8), before)


def test_fp8_linear_per_tensor():
    gen = torch.Generator().manual_seed(1)
    module = hf_fp8.FP8Linear(48, 24, block_size=None)
    _fill(module.weight, module.weight_scale_inv, gen)
    expected = hf_fp8._dequantize_fp8_weight(
        module.weight, module.weight_scale_inv, None, torch.float32
    )
    assert torch.equal(_dequantize(adopt_module(module)), expected)


def test_fp8_experts_stacked_gate_up():
    gen = torch.Generator().manual_seed(2)
    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=2)
    module = hf_fp8.FP8Experts(config, block_size=(16, 16))
    for name in ("gate_up_proj", "down_proj"):
        _fill(getattr(module, name), getattr(module, f"{name}_scale_inv"), gen)
    payloads = adopt_module(module)
    assert set(payloads) == {"gate_up_proj", "down_proj"}
    assert payloads["gate_up_proj"].layout["gate_up"] == "stacked"
    for name, payload in payloads.items():
        weight, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
        expected = hf_fp8._dequantize_fp8_weight(weight, scale, [16, 16], torch.float32)
        assert payload.shape == tuple(weight.shape)
        assert torch.equal(_dequantize(payload), expected)


def test_fp8_experts_small_intermediate_has_one_scale_row_per_half():
    gen = torch.Generator().manual_seed(3)
    config = MixtralConfig(hidden_size=64, intermediate_size=16, num_local_experts=2)
    module = hf_fp8.FP8Experts(config, block_size=(32, 32))
    assert module.gate_up_proj_scale_inv.shape == (2, 2, 2)  # transformers floors rows at 2
    _fill(module.gate_up_proj, module.gate_up_proj_scale_inv, gen)
    # transformers allocates the tensors uninitialised; adoption checks down_proj's scales too
    _fill(module.down_proj, module.down_proj_scale_inv, gen)
    payload = adopt_module(module)["gate_up_proj"]
    scale = module.gate_up_proj_scale_inv.repeat_interleave(16, 1).repeat_interleave(32, 2)
    assert torch.equal(_dequantize(payload), module.gate_up_proj.float() * scale)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp4_experts_match_transformers_fp4_dequantization(scale_fmt):
    gen = torch.Generator().manual_seed(4)
    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=2)
    module = hf_fp8.FP8Experts(config, block_size=None, scale_fmt=scale_fmt, expert_dtype="fp4")
    oracle = hf_fp8.Fp8Dequantize(None)
    for name in ("gate_up_proj", "down_proj"):
        weight, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
        with torch.no_grad():
            weight.copy_(torch.randint(-128, 128, weight.shape, generator=gen).to(torch.int8))
            exponents = torch.randint(-8, 4, scale.shape, generator=gen)
            if scale_fmt == "ue8m0":
                scale.copy_((exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu))
            else:
                scale.copy_(torch.exp2(exponents.float()))
    payloads = adopt_module(module)
    for name, payload in payloads.items():
        weight, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
        assert payload.format.name == "mxfp4"
        expected = oracle._dequantize_one(weight, scale, torch.float32)
        assert torch.equal(_dequantize(payload), expected)


def test_fp4_experts_with_non_power_of_two_scales_raise():
    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=2)
    module = hf_fp8.FP8Experts(config, block_size=None, expert_dtype="fp4")
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(module, name).zero_()
            getattr(module, f"{name}_scale_inv").fill_(0.3)
    with pytest.raises(NotImplementedError, match="not exact powers of two"):
        adopt_module(module)


def test_fp8_embedding():
    gen = torch.Generator().manual_seed(5)
    module = hf_fp8.FP8Embedding(50, 16)
    _fill(module.weight, module.weight_scale, gen)
    expected = module.weight.float() * module.weight_scale
    assert torch.equal(_dequantize(adopt_module(module)), expected)
