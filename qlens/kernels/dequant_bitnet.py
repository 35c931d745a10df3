"""Triton dequantize kernel for BitNet ternary weights, bit-exact with ``qlens.quant.codecs.bitnet``.

``data`` is ``uint8 [R, ...]`` with ``R = ceil(N/4)``: bits ``[2i, 2i+1]`` of packed row ``r`` hold
``T[i*R + r] + 1``. Each program reads a tile of packed bytes once and writes its four output rows:
``W = T / weight_scale`` (correctly rounded division, as torch) or ``W = T * weight_scale``.
A code 3 in a row that holds a weight is invalid: the kernel writes NaN there (the only way a
finite, non-zero scale gives NaN), and the value check raises on it unless checks are off.
"""

from __future__ import annotations

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.dequant_launch import DequantLaunch, k_first_grid, k_first_tile
from qlens.kernels.launch import on_device
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import interpreting, require_kernel_device
from qlens.quant.codecs.bitnet import VALUES_PER_BYTE
from qlens.quant.codecs.checks import (
    ceil_div,
    require_dtype,
    require_finite,
    require_same_device,
    require_shape,
    require_tensor,
)
from qlens.quant.payload import QuantPayload

BITNET_FORMATS = ("bitnet",)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CONVENTIONS = ("divide", "multiply")
# Packed rows x columns per program: few big tiles in the interpreter. On the GPU the fastest
# tile of the H200 sweep (dequant_library_h200.md).
GPU_LAUNCH = DequantLaunch(2, 1024, 2)
INTERPRETER_LAUNCH = DequantLaunch(32, 512, 4)


@triton.jit
@no_type_check
def _bitnet_kernel(
    data_ptr, scale_ptr, out_ptr, N, K, R, stride_r, stride_k,
    DIVIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Packed rows ``[BLOCK_R]`` x columns ``[BLOCK_K]`` -> the four output rows of each."""
    row_tile, k_tile = k_first_tile(K, BLOCK_K)
    offs_r = row_tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = k_tile.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_tile = (offs_r < R)[:, None] & (offs_k < K)[None, :]
    packed = tl.load(
        data_ptr + offs_r[:, None] * stride_r + offs_k[None, :] * stride_k, mask=in_tile, other=0
    )
    # t / scale (or t * scale) for t in {-1, 0, 1}, rounded once per program: IEEE division and
    # multiplication are sign-symmetric, so selecting among them equals the per-element op.
    scale = tl.load(scale_ptr)
    one = tl.full((1, 1), 1.0, tl.float32)
    zero = tl.full((1, 1), 0.0, tl.float32)
    if DIVIDE:
        plus, naught = tl.math.div_rn(one, scale), tl.math.div_rn(zero, scale)
    else:
        plus, naught = one * scale, zero * scale
    nan = tl.full((1, 1), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    for i in tl.static_range(4):
        code = (packed >> (2 * i)) & 3
        rows = i * R + offs_r
        mask = in_tile & (rows < N)[:, None]
        w = tl.where(code == 2, plus, tl.where(code == 0, -plus, tl.where(code == 1, naught, nan)))
        out = cast_out(w, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(out_ptr + rows[:, None] * K + offs_k[None, :], out, mask=mask)


def _weight_scale(payload: QuantPayload) -> Tensor:
    """The scalar ``weight_scale`` (dtype and size checked) as float32 ``[1]``."""
    scale = require_tensor(payload.global_scale, "global_scale", payload, "pass weight_scale")
    require_dtype(scale, "global_scale", (torch.float32, torch.bfloat16, torch.float16), payload)
    if scale.numel() != 1:
        raise ValueError(
            f"bitnet payload `global_scale` must be one scalar weight_scale, got shape "
            f"{list(scale.shape)}"
        )
    return scale.reshape(1).to(torch.float32)


def _require_valid_values(payload: QuantPayload, scale: Tensor, out: Tensor) -> None:
    """The codec's errors for a non-finite or zero scale and for code 3 (a NaN in ``out``
    while the scale is finite and non-zero); one device sync."""
    finite, nonzero, codes_ok = torch.cat(
        [torch.isfinite(scale), scale != 0, ~torch.isnan(out).any().reshape(1)]
    ).tolist()
    if not finite:
        require_finite(
            require_tensor(payload.global_scale, "global_scale"), "global_scale", payload
        )
    if not nonzero:
        raise ValueError("bitnet payload `global_scale` (weight_scale) is 0: the weight is corrupt")
    if not codes_ok:
        raise ValueError(
            "BitNet packed weights hold the invalid 2-bit code 3 (only 0, 1, 2 = -1, 0, 1)"
        )


def dequantize_bitnet_triton(
    payload: QuantPayload,
    dtype: torch.dtype = torch.bfloat16,
    *,
    launch: DequantLaunch | None = None,
    check_values: bool = True,
) -> Float[Tensor, "out *rest"]:
    """Dense weight of a ``bitnet`` payload (either scale convention), decoded by Triton.

    Bit-exact with ``qlens.dequantize(payload, dtype)`` for float32, bfloat16 and float16.
    ``launch``: each program reads ``block_n`` packed rows (four output rows each) by
    ``block_k`` columns (default ``GPU_LAUNCH``).
    ``check_values`` raises the codec's error for a non-finite or zero scale or a code 3 (one
    device sync and one read of the output); ``False`` skips it (no sync) and a code 3 then
    decodes as NaN.
    """
    if payload.format.name not in BITNET_FORMATS:
        raise ValueError(
            f"dequantize_bitnet_triton reads 'bitnet' payloads, not {payload.format.name!r}; use "
            "qlens.kernels.dequantize_triton or qlens.dequantize"
        )
    if dtype not in _OUT_DTYPES:
        raise ValueError(
            f"dequantize_bitnet_triton outputs {list(_OUT_DTYPES)}, not {dtype}; use "
            "qlens.dequantize for other dtypes"
        )
    convention = payload.format.global_scale
    if convention not in _CONVENTIONS:
        raise ValueError(
            f"bitnet format.global_scale must be 'divide' or 'multiply', got {convention!r}"
        )
    shape = tuple(int(s) for s in payload.shape)
    if not shape:
        raise ValueError("a bitnet payload needs a shape of at least one dimension [out, ...]")
    require_kernel_device(payload.data.device)
    require_same_device(payload)
    scale = _weight_scale(payload)
    require_dtype(payload.data, "data", (torch.uint8,), payload)
    packed_rows = ceil_div(shape[0], VALUES_PER_BYTE)
    require_shape(
        payload.data,
        "data",
        (packed_rows, *shape[1:]),
        payload,
        fix="4 ternary values per byte along out",
    )
    out = torch.empty(shape, dtype=dtype, device=payload.data.device)
    if out.numel():
        data = payload.data.reshape(packed_rows, -1)
        n, k = shape[0], data.shape[1]
        tile = launch or (INTERPRETER_LAUNCH if interpreting() else GPU_LAUNCH)
        grid = k_first_grid(packed_rows, k, tile.block_n, tile.block_k)
        with on_device(out.device):
            _bitnet_kernel[grid](
                data, scale, out, n, k, packed_rows, data.stride(0), data.stride(1),
                DIVIDE=convention == "divide", BLOCK_R=tile.block_n, BLOCK_K=tile.block_k,
                INTERPRET=interpreting(), num_warps=tile.num_warps, enable_fp_fusion=False,
            )  # fmt: skip
    if check_values:
        _require_valid_values(payload, scale, out)
    return out
