"""Triton dequantize kernel for GGUF (GGML) 32-weight blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Reads the raw blocks per row exactly as ``qlens.quant.codecs.gguf`` does: a little-endian float16
``d`` (and, for Q4_1/Q5_1, a float16 ``m``) reinterpreted from its two bytes, then the codes
(Q4: low nibbles = elements 0-15, high = 16-31; Q5: plus a fifth bit from a little-endian
32-bit mask; Q8: int8). ``W = d * (q - offset)`` or ``W = d * q + m``, rounded in that order (FMA
contraction is disabled), bit-exact with the codec in float32. ``extras["input_permutation"]``
is applied by storing block column ``j`` at logical column ``perm[j]``.
"""

from __future__ import annotations

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.dequant_launch import DequantLaunch, k_first_grid, k_first_tile
from qlens.kernels.formats import GGUF_KERNEL_FORMATS, GGUF_KERNEL_TYPES
from qlens.kernels.launch import on_device
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import interpreting, require_kernel_device
from qlens.quant.codecs.gguf import (
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    GgmlType,
    gguf_input_permutation,
    validate_gguf_payload,
)
from qlens.quant.payload import QuantPayload

_BY_NAME = dict(zip(GGUF_KERNEL_FORMATS, GGUF_KERNEL_TYPES, strict=True))
_CODE_BITS = {Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5, Q8_0: 8}
_WITH_MIN = (Q4_1, Q5_1)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GGML_BLOCK = 32
# Rows x columns (whole GGML blocks) per program: few big tiles in the interpreter. On the GPU
# two rows of 1024 columns on two warps: the best tile, or close to it, for every type in the
# H200 sweep of dequant_library_h200.md.
GPU_LAUNCH = DequantLaunch(2, 1024, 2)
INTERPRETER_LAUNCH = DequantLaunch(32, 1024, 4)


@triton.jit
@no_type_check
def _le_u32(block_ptr, offset: tl.constexpr, N_BYTES: tl.constexpr, stride_b, mask):
    """The little-endian unsigned integer of ``N_BYTES`` bytes at ``offset`` of each block."""
    value = tl.load(block_ptr + offset * stride_b, mask=mask, other=0).to(tl.uint32)
    for i in tl.static_range(1, N_BYTES):
        byte = tl.load(block_ptr + (offset + i) * stride_b, mask=mask, other=0).to(tl.uint32)
        value = value | (byte << (8 * i))
    return value


@triton.jit
@no_type_check
def _f16_at(block_ptr, offset: tl.constexpr, stride_b, mask):
    """float32 of the little-endian float16 at byte ``offset`` of each block (bit pattern)."""
    bits = _le_u32(block_ptr, offset, 2, stride_b, mask).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
@no_type_check
def _gguf_kernel(
    data_ptr, perm_ptr, out_ptr, ROWS, K, stride_r, stride_b,
    TYPE_SIZE: tl.constexpr, CODE_BITS: tl.constexpr, HAS_MIN: tl.constexpr,
    HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """``BLOCK_N`` rows x ``BLOCKS`` GGML blocks, as ``[BLOCK_N, BLOCKS, 32 or 16]`` tiles."""
    HEADER: tl.constexpr = 4 if HAS_MIN else 2
    row_tile, k_tile = k_first_tile(K, BLOCKS * 32)
    offs_n = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    blocks = k_tile.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    mask = (offs_n < ROWS)[:, None, None] & (blocks < K // 32)[None, :, None]
    block_ptr = (
        data_ptr + offs_n[:, None, None] * stride_r + (blocks * TYPE_SIZE)[None, :, None] * stride_b
    )
    rows_out = offs_n[:, None, None] * K
    cols = (blocks * 32)[None, :, None]
    d = _f16_at(block_ptr, 0, stride_b, mask)  # [BLOCK_N, BLOCKS, 1]
    if CODE_BITS == 8:
        j = tl.arange(0, 32)[None, None, :]
        q = tl.load(block_ptr + (HEADER + j) * stride_b, mask=mask, other=0)
        w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
        _store(out_ptr, perm_ptr, rows_out, cols + j, K, w, mask, HAS_PERM, INTERPRET)
    else:
        j = tl.arange(0, 16)[None, None, :]
        CODES: tl.constexpr = HEADER + 4 if CODE_BITS == 5 else HEADER
        packed = tl.load(block_ptr + (CODES + j) * stride_b, mask=mask, other=0)
        if HAS_MIN:
            m = _f16_at(block_ptr, 2, stride_b, mask)
        if CODE_BITS == 5:  # bit j of this little-endian 32-bit mask is element j's fifth bit
            fifth = _le_u32(block_ptr, HEADER, 4, stride_b, mask)
        for half in tl.static_range(2):  # low nibbles: elements 0-15, high: 16-31
            q = ((packed >> (4 * half)) & 0xF).to(tl.int32)
            if CODE_BITS == 5:
                q = q | (((fifth >> (16 * half + j).to(tl.uint32)) & 1).to(tl.int32) << 4)
            if HAS_MIN:
                w = d * q.to(tl.float32) + m
            else:
                w = d * (q - (1 << (CODE_BITS - 1))).to(tl.float32)
            _store(
                out_ptr, perm_ptr, rows_out, cols + 16 * half + j, K, w, mask, HAS_PERM, INTERPRET
            )


@triton.jit
@no_type_check
def _store(out_ptr, perm_ptr, rows_out, cols, K, w, mask, HAS_PERM: tl.constexpr,
           INTERPRET: tl.constexpr):  # fmt: skip
    """Store ``w`` at ``[row, col]``, or at ``[row, perm[col]]`` for a permuted input."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols, mask=cols < K, other=0)
    out = cast_out(w, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + rows_out + cols, out, mask=mask)


def _kernel_ggml_type(payload: QuantPayload) -> GgmlType:
    """The payload's GGML type if this kernel reads it; the payload is validated by the codec."""
    if payload.format.name not in _BY_NAME:
        raise ValueError(
            f"the GGUF Triton dequantize kernel reads {list(GGUF_KERNEL_FORMATS)}, not "
            f"{payload.format.name!r}; use qlens.dequantize(payload, dtype) (torch) for other "
            "GGML types"
        )
    return validate_gguf_payload(payload)


def dequantize_gguf_triton(
    payload: QuantPayload,
    dtype: torch.dtype = torch.bfloat16,
    *,
    launch: DequantLaunch | None = None,
    check_values: bool = True,
) -> Float[Tensor, "*rows cols"]:
    """Dense weight of a GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 payload, decoded by a Triton kernel.

    Bit-exact with ``qlens.dequantize(payload, dtype)`` for float32, bfloat16 and float16.
    ``launch``: each program decodes ``block_n`` rows by ``block_k`` columns (whole 32-weight
    blocks, so at least 32; default ``GPU_LAUNCH``). ``check_values`` verifies that
    ``extras["input_permutation"]`` is a permutation (one device sync); ``False`` trusts it (no
    sync).
    """
    ggml_type = _kernel_ggml_type(payload)
    if dtype not in _OUT_DTYPES:
        raise ValueError(
            f"dequantize_gguf_triton outputs {list(_OUT_DTYPES)}, not {dtype}; use "
            "qlens.dequantize for other dtypes"
        )
    shape = tuple(int(s) for s in payload.shape)
    require_kernel_device(payload.data.device)
    k = shape[-1]
    perm = gguf_input_permutation(payload, check_values=check_values)
    out = torch.empty(shape, dtype=dtype, device=payload.data.device)
    if out.numel() == 0:
        return out
    rows = out.numel() // k
    data = payload.data.reshape(rows, -1)
    tile = launch or (INTERPRETER_LAUNCH if interpreting() else GPU_LAUNCH)
    if tile.block_k < GGML_BLOCK:
        raise ValueError(
            f"a GGUF dequantize tile spans whole {GGML_BLOCK}-weight blocks: block_k must be at "
            f"least {GGML_BLOCK}, got {tile.block_k}"
        )
    blocks = min(tile.block_k // GGML_BLOCK, triton.next_power_of_2(k // GGML_BLOCK))
    grid = k_first_grid(rows, k, tile.block_n, blocks * GGML_BLOCK)
    with on_device(out.device):
        _gguf_kernel[grid](
            data, data if perm is None else perm, out, rows, k, data.stride(0), data.stride(1),
            TYPE_SIZE=ggml_type.type_size, CODE_BITS=_CODE_BITS[ggml_type],
            HAS_MIN=ggml_type in _WITH_MIN, HAS_PERM=perm is not None, BLOCK_N=tile.block_n,
            BLOCKS=blocks, INTERPRET=interpreting(), num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out
