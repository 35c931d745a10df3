"""Dynamic per-token FP8 (e4m3) activation quantization, one float32 scale per 1 x group.

``quantize_activations`` writes codes and scales for the FP8 GEMMs; the device functions also
serve the W8A8 GEMV, which quantizes its activation tile in registers with the same rounding.
"""

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Float8e4m3fn
from torch import Tensor

from qlens.kernels.launch import on_device
from qlens.kernels.numerics import f32_to_e4m3_bits
from qlens.kernels.runtime import interpreting


@triton.jit
@no_type_check
def quantize_groups(x, INTERPRET: tl.constexpr):
    """Dynamic FP8 of float32 rows ``x[r, :]`` (one group each): e4m3 bytes and the float32
    scale ``amax / 448`` per row (1 for an all-zero row), divisions correctly rounded."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    if INTERPRET:
        codes = f32_to_e4m3_bits(v)
    else:
        codes = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return codes, scale


@triton.jit
@no_type_check
def quantize_dequantize_tile(x, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                             INTERPRET: tl.constexpr):  # fmt: skip
    """float32 ``x[BLOCK_K]`` (aligned to ``GROUP``) as W8A8 sees it: each group's e4m3 codes
    times its scale, quantized exactly as ``quantize_activations`` does."""
    codes, scale = quantize_groups(tl.reshape(x, (BLOCK_K // GROUP, GROUP)), INTERPRET)
    x_hat = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    return tl.reshape(x_hat, (BLOCK_K,))


@triton.jit
@no_type_check
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    offs_k = g * GROUP + tl.arange(0, GROUP)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    codes, scale = quantize_groups(x.to(tl.float32), INTERPRET)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], codes, mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + g * stride_sg, scale, mask=offs_m < M)


# Rows per activation-quantization program on a GPU (one program: BLOCK_M rows x one group).
ACT_QUANT_BLOCK_M = 16


def quantize_activations(
    x: Float[Tensor, "m k"], group: int = 128, *, block_m: int | None = None
) -> tuple[Float8e4m3fn[Tensor, "m k"], Float[Tensor, "m groups"]]:
    """Per-token, per-``group`` dynamic FP8: ``x ~ q * s`` with ``s = amax / 448`` (1 for zeros).

    Returns e4m3 codes ``[m, k]`` and float32 scales ``[m, ceil(k / group)]`` stored
    column-major (strides ``(1, m)``), the layout cuBLAS' blockwise FP8 GEMM takes, so no
    transposing copy follows. ``block_m`` overrides the rows per program (benchmarks sweep it).
    """
    m, k = x.shape
    groups = triton.cdiv(k, group)
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    if block_m is None:
        block_m = 64 if interpreting() else ACT_QUANT_BLOCK_M
    with on_device(x.device):
        _act_quant_kernel[(triton.cdiv(m, block_m), groups)](
            x, codes, scales, m, k, x.stride(0), codes.stride(0), scales.stride(0),
            scales.stride(1), GROUP=group, BLOCK_M=block_m, INTERPRET=interpreting(),
        )  # fmt: skip
    return codes.view(torch.float8_e4m3fn), scales
