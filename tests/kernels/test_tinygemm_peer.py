"""The kernel benchmarks' tinygemm peer: qlens int4 codes and scales handed to torch's int4 GEMM
give the product with the dequantized weight (CPU kernel here, CUDA kernel on a GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import _tinygemm
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight


def int4_payload(n: int, k: int, device: str = "cpu"):
    torch.manual_seed(0)
    return quantize_weight(torch.randn(n, k, device=device), "int4", group_size=128)


def check_product(p, x: torch.Tensor) -> None:
    out = _tinygemm.tinygemm_int4(p)(x).double()
    # tinygemm holds the scales in bf16: the reference dequantizes with the same rounded scales.
    scales = p.scales.to(torch.bfloat16).double().repeat_interleave(128, 1)
    w = (_tinygemm.int4_codes(p) - 8).double() * scales
    ref = x.double() @ w.T
    # Products of bf16 values rounded to bf16 (2**-9 relative each), fp32 sums, a bf16 output.
    bound = (x.double().abs() @ w.abs().T) * 2**-7
    assert torch.all((out - ref).abs() <= bound), ((out - ref).abs() / bound).max()


def test_codes_and_scales_in_tinygemm_layout():
    p = int4_payload(16, 256)
    codes = _tinygemm.int4_codes(p)
    assert codes.shape == (16, 256) and codes.dtype == torch.int32
    w = (codes - 8).float() * p.scales.repeat_interleave(128, 1)
    assert torch.equal(w, dequantize(p, torch.float32))
    sz = _tinygemm.scales_and_zeros(p)
    assert sz.shape == (2, 16, 2) and sz.dtype == torch.bfloat16
    assert torch.equal(sz[..., 0], p.scales.to(torch.bfloat16).t()) and not sz[..., 1].any()
    packed = _tinygemm.cuda_packed(codes)  # torch's tests pack the even column high
    assert torch.equal((packed >> 4).int(), codes[:, ::2])
    assert torch.equal((packed & 0xF).int(), codes[:, 1::2])


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no CPU tinygemm"
)
@pytest.mark.parametrize("m", [1, 5])
def test_cpu_tinygemm_matches_the_dequantized_product(m):
    p = int4_payload(32, 384)  # the CPU kernel takes N in multiples of 16
    check_product(p, torch.randn(m, 384).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_cuda_tinygemm_matches_the_dequantized_product(m):
    p = int4_payload(256, 1024, "cuda")
    check_product(p, torch.randn(m, 1024, device="cuda").to(torch.bfloat16))


def test_shapes_tinygemm_cannot_take_are_refused():
    with pytest.raises(
        ValueError, match=r"tinygemm needs N % 8 == 0 and K % 128 == 0; got \[12, 256\]"
    ):
        _tinygemm.int4_codes(int4_payload(12, 256))
    asym = quantize_weight(torch.randn(8, 256), "int4", group_size=128, asymmetric=True)
    with pytest.raises(
        ValueError, match="tinygemm takes symmetric int4 payloads; got int4 with zero"
    ):
        _tinygemm.int4_codes(asym)
