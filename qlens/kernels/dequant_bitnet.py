"""Triton dequantize kernel for BitNet ternary weights, bit-exact with ``qlens.quant.codecs.bitnet``.

``data`` is ``uint8 [R, ...]`` with ``R = ceil(N/4)``: bits ``[2i, 2i+1]`` of packed row ``r`` hold
``T[i*R + r] + 1``. Each program reads a tile of packed bytes once and writes its four output rows:
``W = T / weight_scale`` (correctly rounded division, as torch) or ``W = T * weight_scale``.
The four possible outputs are rounded once per program. 16-bit outputs of contiguous rows of
whole words take a word-wise kernel: each int32 word (four columns) becomes two output words per
row through two byte permutes (``prmt``) of that four-entry table, against one select chain and
one conversion per value in the byte-wise kernel.
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
from qlens.kernels.formats import BITNET_FORMATS
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

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CONVENTIONS = ("divide", "multiply")
_WORD_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Packed rows x columns per program: few big tiles in the interpreter. On the GPU the fastest
# tile of the H200 sweep (dequant_library_h200.md).
GPU_LAUNCH = DequantLaunch(2, 1024, 2)
INTERPRETER_LAUNCH = DequantLaunch(32, 512, 4)


@triton.jit
@no_type_check
def _ternary_values(scale_ptr, DIVIDE: tl.constexpr):
    """``(+1, 0)`` divided by (or times) the scale, as float32 ``[1, 1]``: IEEE division and
    multiplication are sign-symmetric, so selecting among ``-plus, naught, plus`` equals the
    per-element operation."""
    scale = tl.load(scale_ptr)
    one = tl.full((1, 1), 1.0, tl.float32)
    zero = tl.full((1, 1), 0.0, tl.float32)
    if DIVIDE:
        return tl.math.div_rn(one, scale), tl.math.div_rn(zero, scale)
    return one * scale, zero * scale


@triton.jit
@no_type_check
def _bits16(value, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The 16-bit pattern of ``value`` rounded to ``OUT_DTYPE``, in the low half of a uint32."""
    half = cast_out(value, OUT_DTYPE, INTERPRET).to(tl.int16, bitcast=True)
    return half.to(tl.int32).to(tl.uint32, bitcast=True) & 0xFFFF


@triton.jit
@no_type_check
def _permute_bytes(lo, hi, selector, USE_ASM: tl.constexpr):
    """PTX ``prmt.b32`` (default mode) on uint32 tensors: byte ``j`` of the result is byte
    ``(selector >> 4j) & 7`` of the eight bytes ``{hi, lo}``; plain Triton in the interpreter."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, selector], dtype=tl.uint32,
            is_pure=True, pack=1,
        )  # fmt: skip
    out = tl.zeros_like(selector)
    for j in tl.static_range(4):
        index = (selector >> (4 * j)) & 7
        source = tl.where(index < 4, lo, hi)
        out = out | (((source >> (8 * (index & 3))) & 0xFF) << (8 * j))
    return out


@triton.jit
@no_type_check
def _bitnet_words_kernel(
    words_ptr, scale_ptr, out_ptr, N, WORDS, R, stride_r,
    DIVIDE: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr, USE_ASM: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Packed rows ``[BLOCK_R]`` x int32 words ``[BLOCK_W]`` (four columns each) -> the four
    output rows of each, written through ``out_ptr`` as int32 pairs of 16-bit values."""
    row_tile, w_tile = k_first_tile(WORDS, BLOCK_W)
    offs_r = row_tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    # Two words (16 output bytes a row) per thread: the load's layout is then the store's.
    offs_w = tl.max_contiguous(w_tile.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W), 2)
    in_tile = (offs_r < R)[:, None] & (offs_w < WORDS)[None, :]
    words = tl.load(words_ptr + offs_r[:, None] * stride_r + offs_w[None, :], mask=in_tile, other=0)
    words = words.to(tl.uint32, bitcast=True)
    plus, naught = _ternary_values(scale_ptr, DIVIDE)
    nan = tl.full((1, 1), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    # The table {hi, lo}: the 16-bit value of code c at bytes 2c and 2c + 1.
    lo = _bits16(-plus, OUT_DTYPE, INTERPRET) | (_bits16(naught, OUT_DTYPE, INTERPRET) << 16)
    hi = _bits16(plus, OUT_DTYPE, INTERPRET) | (_bits16(nan, OUT_DTYPE, INTERPRET) << 16)
    lo = tl.broadcast_to(lo, (BLOCK_R, BLOCK_W))
    hi = tl.broadcast_to(hi, (BLOCK_R, BLOCK_W))
    offs_o = w_tile.to(tl.int64) * (2 * BLOCK_W) + tl.arange(0, 2 * BLOCK_W)
    for i in tl.static_range(4):
        codes = (words >> (2 * i)) & 0x03030303  # row i's code of each byte (column)
        # Selector nibbles 2c, 2c + 1 for the codes of bytes 0, 1 (and 2, 3): value of code c.
        first = _permute_bytes(lo, hi, (codes & 0x0303) * 0x22 + 0x1010, USE_ASM)
        second = _permute_bytes(lo, hi, ((codes >> 16) & 0x0303) * 0x22 + 0x1010, USE_ASM)
        pairs = tl.reshape(tl.join(first, second), (BLOCK_R, 2 * BLOCK_W))
        rows = i * R + offs_r
        mask = ((offs_r < R) & (rows < N))[:, None] & (offs_o < 2 * WORDS)[None, :]
        tl.store(
            out_ptr + rows[:, None] * (2 * WORDS) + offs_o[None, :],
            pairs.to(tl.int32, bitcast=True),
            mask=mask,
        )


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
    plus, naught = _ternary_values(scale_ptr, DIVIDE)
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


def _whole_words(data: Tensor) -> bool:
    """Whether ``data`` ``[R, k]`` reads as int32 words: contiguous rows of whole, aligned words."""
    return (
        data.shape[1] % 4 == 0
        and data.stride(1) == 1
        and data.stride(0) % 4 == 0
        and data.data_ptr() % 4 == 0
    )


def _launch(
    data: Tensor, scale: Tensor, out: Tensor, n: int, divide: bool, tile: DequantLaunch
) -> None:
    """Decode ``data`` ``[R, k]`` into ``out``: word-wise for 16-bit outputs of whole words."""
    rows, k = data.shape
    if out.dtype in _WORD_OUT_DTYPES and _whole_words(data):
        words = data.view(torch.int32)
        block_w = tile.block_k // 4
        _bitnet_words_kernel[k_first_grid(rows, k // 4, tile.block_n, block_w)](
            words, scale, out.view(n, k).view(torch.int32), n, k // 4, rows, words.stride(0),
            DIVIDE=divide, OUT_DTYPE=_WORD_OUT_DTYPES[out.dtype], BLOCK_R=tile.block_n,
            BLOCK_W=block_w, USE_ASM=not interpreting(), INTERPRET=interpreting(),
            num_warps=tile.num_warps, enable_fp_fusion=False,
        )  # fmt: skip
        return
    _bitnet_kernel[k_first_grid(rows, k, tile.block_n, tile.block_k)](
        data, scale, out, n, k, rows, data.stride(0), data.stride(1),
        DIVIDE=divide, BLOCK_R=tile.block_n, BLOCK_K=tile.block_k, INTERPRET=interpreting(),
        num_warps=tile.num_warps, enable_fp_fusion=False,
    )  # fmt: skip


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
        tile = launch or (INTERPRETER_LAUNCH if interpreting() else GPU_LAUNCH)
        with on_device(out.device):
            _launch(data, scale, out, shape[0], convention == "divide", tile)
    if check_values:
        _require_valid_values(payload, scale, out)
    return out
