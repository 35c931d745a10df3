"""MX and NVFP4 against torchao: dequantization of its tensors, and qlens' quantizer's codes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.quant.codecs.mx import pack_mx
from qlens.quant.codecs.nvfp4 import pack_nvfp4
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

ELEMENTS = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}


def _weight(seed: int, rows: int, cols: int, spread: int) -> torch.Tensor:
    """Rows and 32-blocks spanning ``2 * spread`` binades (normal fp32 range only)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    exponents = torch.randint(-spread, spread + 1, (rows, cols // 16), generator=gen)
    return w * torch.ldexp(torch.ones(exponents.shape), exponents).repeat_interleave(16, -1)


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4"])
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), blocks=st.integers(1, 4))
def test_mx_matches_torchao(scheme, seed, rows, blocks):
    w = _weight(seed, rows, 32 * blocks, spread=40)
    theirs = mx_tensor.MXTensor.to_mx(w, ELEMENTS[scheme], block_size=32)
    qdata = theirs.qdata.view(torch.uint8) if scheme == "mxfp4" else theirs.qdata
    payload = pack_mx(qdata, theirs.scale, tuple(w.shape))
    assert torch.equal(dequantize(payload), theirs.dequantize(torch.float32))
    ours = quantize_weight(w, scheme)  # OCP floor(log2 amax) - emax, like torchao's FLOOR mode
    assert torch.equal(ours.scales, theirs.scale.view(torch.uint8))
    assert torch.equal(ours.data.view(torch.uint8), qdata.view(torch.uint8))


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("two_level", [False, True])
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 140), blocks=st.integers(1, 5))
def test_nvfp4_matches_torchao(swizzled, two_level, seed, rows, blocks):
    w = _weight(seed, rows, 16 * blocks, spread=3)
    g = nvfp4_tensor.per_tensor_amax_to_scale(w.abs().amax()) if two_level else None
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=g, is_swizzled_scales=swizzled)
    payload = pack_nvfp4(
        theirs.qdata.view(torch.uint8),
        theirs.scale,
        g if two_level else torch.tensor(1.0),
        tuple(w.shape),
        layout={"scale_swizzle": "32_4_4" if swizzled else "none"},
    )
    # torchao computes fp4 * (g * s) too, so the results agree bit for bit
    assert torch.equal(dequantize(payload), theirs.dequantize(torch.float32))
    if two_level and not swizzled:
        ours = quantize_weight(w, "nvfp4")
        assert torch.equal(ours.global_scale, g.reshape(()))
        assert torch.equal(ours.scales.view(torch.uint8), theirs.scale.view(torch.uint8))
        assert torch.equal(ours.data, theirs.qdata.view(torch.uint8))


@pytest.mark.parametrize(("rows", "swizzled"), [(130, False), (128, True)])
def test_nvfp4_experts_match_torchao(rows, swizzled):
    # torchao swizzles experts as one stacked matrix, which equals per-expert tiles only when
    # the rows are a multiple of 128
    w = _weight(3, 2 * rows, 48, spread=3).reshape(2, rows, 48)
    g = nvfp4_tensor.per_tensor_amax_to_scale(w.abs().amax())
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=g, is_swizzled_scales=swizzled)
    payload = pack_nvfp4(
        theirs.qdata.view(torch.uint8),
        theirs.scale.reshape(2, -1, theirs.scale.shape[-1]),
        g,
        (2, rows, 48),
        layout={"scale_swizzle": "32_4_4" if swizzled else "none"},
    )
    assert torch.equal(dequantize(payload), theirs.dequantize(torch.float32))
