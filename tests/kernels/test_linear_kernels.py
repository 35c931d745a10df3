"""Weight-only quantized linear kernels in Triton's interpreter against the torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernel_cases import SCHEMES, quantized, rel_err, scheme_id

from qlens.kernels import LinearConfig, quantized_linear, reference_linear
from qlens.quant.dequantize import dequantize

# The interpreter computes in float32 (its bf16 dot is wrong), so the error left is the output
# rounding: bf16 2**-9, fp16 2**-11 relative per element; fp32 only summation order.
TOLERANCE = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 1e-6}
PATHS = (
    LinearConfig("gemv", 16, 64, 128, split_k=2),  # one program per row, K split in two
    LinearConfig("splitk", 16, 32, 64, split_k=3),  # K split over 3 programs, ragged last split
    LinearConfig("gemm", 32, 16, 32, group_m=2),  # several M and N tiles, grouped ordering
    LinearConfig("gemm", 16, 32, 64, split_k=2),  # the GEMM with K split (packed: W x^T)
)


def _reference(x, payload, bias):
    """float64 product of the exact dequantized weight."""
    weight = dequantize(payload, torch.float64)
    return F.linear(x.double(), weight, None if bias is None else bias.double())


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("config", PATHS, ids=lambda c: c.path)
def test_every_family_and_path_matches_reference(case, config):
    payload = quantized(40, 200, case)  # N, K not multiples of the tiles or groups
    x = torch.randn(3, 11, 200).bfloat16()
    bias = torch.randn(40).bfloat16()
    out = quantized_linear(x, payload, bias, config=config)
    assert out.shape == (3, 11, 40) and out.dtype == torch.bfloat16
    assert rel_err(out, _reference(x, payload, bias)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_activation_dtypes_and_default_dispatch(dtype):
    payload = quantized(24, 96, ("int4", {"group_size": 32, "asymmetric": True}))
    for m in (1, 9, 70):  # the GEMV, split-K and GEMM paths of the dispatcher
        x = torch.randn(m, 96).to(dtype)
        out = quantized_linear(x, payload)
        assert out.dtype == dtype
        assert rel_err(out, _reference(x, payload, None)) < TOLERANCE[dtype]


def test_reference_linear_is_dequantize_then_matmul():
    payload = quantized(24, 96, ("nvfp4", {}))
    x = torch.randn(5, 96, dtype=torch.float64)
    bias = torch.randn(24, dtype=torch.float64)
    out = reference_linear(x, payload, bias)
    assert out.dtype == torch.float64
    assert torch.equal(out, _reference(x, payload, bias))


def test_split_k_is_deterministic():
    payload = quantized(32, 512, ("mxfp4", {}))
    x = torch.randn(4, 512)
    config = LinearConfig("splitk", 16, 32, 64, split_k=4)
    first = quantized_linear(x, payload, config=config)
    assert torch.equal(first, quantized_linear(x, payload, config=config))


def test_dequant_path_matches_reference():
    payload = quantized(40, 200, ("fp8-block", {}))
    x = torch.randn(9, 200)
    bias = torch.randn(40, dtype=torch.float64)  # a bias in another dtype is cast to x's
    out = quantized_linear(x, payload, bias, config=LinearConfig("dequant", 16, 16, 16))
    assert rel_err(out, _reference(x, payload, bias)) < TOLERANCE[torch.float32]


def test_nvfp4_divide_convention_linear():
    from qlens.quant.codecs.nvfp4 import pack_nvfp4

    base = quantized(24, 96, ("nvfp4", {}))
    payload = pack_nvfp4(
        base.data, base.scales, 2.5 / base.global_scale, (24, 96), global_convention="divide"
    )
    x = torch.randn(6, 96)
    for config in (PATHS[0], PATHS[2]):
        out = quantized_linear(x, payload, config=config)
        assert rel_err(out, _reference(x, payload, None)) < TOLERANCE[torch.float32]


@given(
    m=st.integers(1, 9),
    n=st.integers(1, 40),
    k=st.integers(1, 160),
    case=st.sampled_from(SCHEMES),
    path=st.sampled_from(PATHS),
)
def test_random_ragged_shapes_match_reference(m, n, k, case, path):
    payload = quantized(n, k, case, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    out = quantized_linear(x, payload, config=path)
    ref = _reference(x, payload, None)
    if ref.norm() == 0:  # every weight rounded to zero
        assert bool((out == 0).all())
    else:
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
