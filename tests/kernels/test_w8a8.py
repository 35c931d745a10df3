"""W8A8 block FP8 in Triton's interpreter: activation quantization and the FP8 GEMM."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import quantized, rel_err

from qlens.kernels import LinearConfig, quantized_linear
from qlens.kernels.fp8_w8a8 import quantize_activations
from qlens.kernels.reference import reference_act_quant, reference_w8a8_linear

FP8_CASES = (("fp8-block", {}), ("fp8-block", {"scale_dtype": "e8m0"}))


def test_activation_quant_is_bit_exact_over_all_magnitudes():
    # 1e-12 .. 1e4 covers e4m3 subnormals after scaling, ties and the 448 saturation edge.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 300, generator=gen) * torch.logspace(-12, 4, 300)
    x[3] = 0.0  # an all-zero row gets scale 1
    codes, scales = quantize_activations(x, 128)
    ref_codes, ref_scales = reference_act_quant(x, 128)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (37, 3)
    assert scales.stride() == (1, 37)  # column-major: cuBLAS' blockwise layout, no copy needed
    assert torch.equal(scales, ref_scales)
    # Correctly rounded amax / 448 (not a multiplication by a rounded reciprocal).
    amax = torch.nn.functional.pad(x, (0, 84)).abs().view(37, 3, 128).amax(-1).double()
    assert torch.equal(ref_scales, torch.where(amax == 0, 1.0, amax / 448).float())
    # Other programs (rows x groups; 300 columns end in a partial group) give the same bits.
    for block_m, groups in ((16, 1), (32, 2), (16, 4), (8, 8)):
        again, again_scales = quantize_activations(x, 128, block_m=block_m, groups=groups)
        assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(again_scales, scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert bool((scales[3] == 1).all())
    with pytest.raises(ValueError, match="groups must be a power of two .* got 3"):
        quantize_activations(x, 128, groups=3)


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: str(c[1]) or "fp32")
@pytest.mark.parametrize(
    "config",
    (None, LinearConfig("splitk", 16, 32, 128, split_k=2), LinearConfig("gemm", 32, 32, 128)),
    ids=("auto", "splitk", "gemm"),
)
def test_w8a8_matches_reference(case, config):
    payload = quantized(70, 300, case)
    x = torch.randn(2, 9, 300).bfloat16()
    bias = torch.randn(70).bfloat16()
    out = quantized_linear(x, payload, bias, w8a8=True, config=config)
    ref = reference_w8a8_linear(x.double(), payload, bias.double())
    assert out.shape == (2, 9, 70) and out.dtype == torch.bfloat16
    # float32 products of exactly the reference's codes: only the bf16 output rounding remains.
    assert rel_err(out, ref) < 4e-3


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: str(c[1]) or "fp32")
def test_one_w8a8_row_is_read_rounded_by_the_gemv(case):
    """One row takes the weight-only GEMV, which rounds each K block of the row to FP8 as
    ``quantize_activations`` does: the same products as the reference, in float32."""
    from qlens.kernels.configs import choose_config
    from qlens.kernels.reference import fp8_rounded_activations, reference_linear

    payload = quantized(70, 300, case)  # 300 columns end in a partial K block
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(1, 300, generator=gen) * torch.logspace(-6, 3, 300)).bfloat16()
    x[0, 128:256] = 0.0  # an all-zero block reads as zeros (scale 1)
    bias = torch.randn(70, generator=gen).bfloat16()
    assert choose_config(1, 70, 300, torch.device("cpu"), w8a8=True).path == "gemv"
    out = quantized_linear(x, payload, bias, w8a8=True)
    rounded = fp8_rounded_activations(x.float(), 128)
    exact = reference_linear(rounded.double(), payload, bias.double())
    assert out.shape == (1, 70) and out.dtype == torch.bfloat16
    # float32 sums of the rounded products: within two bf16 output roundings of the exact sum.
    torch.testing.assert_close(
        out.double(), exact, rtol=2**-7, atol=1e-6 * exact.abs().max().item()
    )
    assert rel_err(out, reference_w8a8_linear(x.double(), payload, bias.double())) < 4e-3
    # The row is rounded, not read as it is: weight-only differs.
    assert not torch.equal(out, quantized_linear(x, payload, bias))
    for config in (LinearConfig("gemv", 16, 16, 256, split_k=2), LinearConfig("gemv", 16, 8, 128)):
        again = quantized_linear(x, payload, bias, w8a8=True, config=config)
        torch.testing.assert_close(
            again.double(), exact, rtol=2**-7, atol=1e-6 * exact.abs().max().item()
        )


def test_fp8_rounded_rows_need_one_row_and_whole_k_blocks():
    payload = quantized(16, 256, FP8_CASES[0])
    with pytest.raises(ValueError, match="one-row GEMV only, got 2 rows"):
        quantized_linear(
            torch.randn(2, 256), payload, w8a8=True, config=LinearConfig("gemv", 16, 16, 128)
        )
    with pytest.raises(ValueError, match=r"block_k a multiple of its K block \(128\)"):
        quantized_linear(
            torch.randn(1, 256), payload, w8a8=True, config=LinearConfig("gemv", 16, 16, 64)
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_rounded_rows_are_the_references_bit_for_bit(dtype):
    """One launch writes W8A8's rounded activations in ``x``'s dtype, as the torch reference
    rounds them (the W8A8 experts' inputs on a GPU)."""
    from qlens.kernels.fp8_w8a8 import fp8_rounded_rows
    from qlens.kernels.reference import fp8_rounded_activations

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 300, generator=gen) * torch.logspace(-6, 3, 300)).to(dtype)
    x[3] = 0.0
    for group in (128, 64):
        out = fp8_rounded_rows(x, group)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out, fp8_rounded_activations(x, group).to(dtype)), group
    strided = torch.randn(300, 37, generator=gen).to(dtype).t()
    assert torch.equal(
        fp8_rounded_rows(strided, 128), fp8_rounded_activations(strided, 128).to(dtype)
    )


def test_w8a8_rejects_other_formats():
    payload = quantized(16, 64, ("mxfp8", {}))
    with pytest.raises(ValueError, match="fp8_block weights only"):
        quantized_linear(torch.randn(2, 64), payload, w8a8=True)
