"""Mixture-of-experts linears in Triton's interpreter against a dequantized reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import rel_err

from qlens.kernels import dequantize_triton, experts_linear
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight


@pytest.mark.parametrize("scheme", ("mxfp4", "nvfp4", "int4"))
def test_experts_linear_matches_per_token_reference(scheme):
    gen = torch.Generator().manual_seed(0)
    payload = quantize_weight(torch.randn(4, 24, 64, generator=gen), scheme)
    x = torch.randn(10, 64, generator=gen)
    ids = torch.tensor([3, 0, 3, 1, 0, 3, 3, 1, 0, 0])  # expert 2 unused
    bias = torch.randn(4, 24, generator=gen)
    out = experts_linear(x, payload, ids, bias)
    weights = dequantize(payload, torch.float64)  # [experts, out, in]
    ref = torch.einsum("tk,tnk->tn", x.double(), weights[ids]) + bias.double()[ids]
    assert rel_err(out, ref) < 1e-6


def test_experts_linear_rejects_bad_expert_ids():
    payload = quantize_weight(torch.randn(2, 8, 32), "int8", group_size=32)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 2\)"):
        experts_linear(torch.randn(3, 32), payload, torch.tensor([0, 2, 1]))


def test_dequantize_triton_of_experts_is_bit_exact():
    gen = torch.Generator().manual_seed(2)
    payload = quantize_weight(torch.randn(3, 20, 96, generator=gen), "nvfp4")
    out = dequantize_triton(payload, torch.bfloat16)
    assert out.shape == (3, 20, 96)
    assert torch.equal(out, dequantize(payload, torch.bfloat16))
