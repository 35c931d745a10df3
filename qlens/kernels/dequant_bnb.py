"""Triton dequantize kernels for bitsandbytes weights: 4-bit NF4/FP4 (flat or nested absmax)
and LLM.int8, bit-exact with ``qlens.quant.codecs.bnb`` in float32.

4-bit: the flattened weight's codes, high nibble first, looked up in the 16-entry quant map and
multiplied by their block's absmax; a nested (uint8) absmax is decoded in the kernel as
``nested_code[a] * nested_absmax[block // nested_blocksize] + nested_offset``. int8:
``q * SCB[row] * (1/127)`` in bitsandbytes' order. Launches disable FMA contraction so every
multiply and add rounds as the torch codec's.
"""

from __future__ import annotations

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.dequant_launch import DequantLaunch, k_first_grid, k_first_tile
from qlens.kernels.formats import BNB_FORMATS
from qlens.kernels.launch import on_device
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import interpreting, require_kernel_device
from qlens.quant.codecs.bnb import BNB_BLOCKSIZES, INT8_RECIPROCAL
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
_INT8_RECIPROCAL_C = tl.constexpr(INT8_RECIPROCAL)
# Work per program (few big tiles in the interpreter). 4-bit weights are flat: a program
# decodes block_n * block_k consecutive elements. GPU tiles: the fastest of the H200 sweep
# (dequant_library_h200.md), 8192 elements on 4 warps for 4-bit, 16 x 256 for int8.
GPU_4BIT_LAUNCH, INTERPRETER_4BIT_LAUNCH = DequantLaunch(16, 512, 4), DequantLaunch(64, 128, 4)
GPU_INT8_LAUNCH, INTERPRETER_INT8_LAUNCH = DequantLaunch(16, 256, 4), DequantLaunch(64, 512, 4)


@triton.jit
@no_type_check
def _bnb_4bit_kernel(
    data_ptr, code_ptr, absmax_ptr, nested_absmax_ptr, nested_code_ptr, nested_offset_ptr,
    out_ptr, numel,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
    BLOCK: tl.constexpr, EVEN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``BLOCK`` flattened elements (a whole number of absmax blocks) per program; ``EVEN``:
    ``numel`` is a multiple of ``BLOCK`` (no masks, so the packed bytes load as wide vectors)."""
    HALF: tl.constexpr = BLOCK // 2
    BLOCKS: tl.constexpr = BLOCK // BLOCKSIZE
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs_byte = tl.program_id(0).to(tl.int64) * HALF + tl.arange(0, HALF)  # visibly aligned
    if EVEN:
        packed = tl.load(data_ptr + offs_byte)
    else:
        packed = tl.load(data_ptr + offs_byte, mask=offs_byte < (numel + 1) // 2, other=0)
    # Element 2j is byte j's high nibble, element 2j + 1 its low nibble.
    codes = tl.reshape(tl.join(packed >> 4, packed & 0xF), (BLOCK,)).to(tl.int32)
    values = tl.load(code_ptr + codes)
    blocks = start // BLOCKSIZE + tl.arange(0, BLOCKS)
    in_range = blocks < tl.cdiv(numel, BLOCKSIZE)
    if NESTED:
        nested_codes = tl.load(absmax_ptr + blocks, mask=in_range, other=0).to(tl.int32)
        nested_scale = tl.load(
            nested_absmax_ptr + blocks // NESTED_BLOCKSIZE, mask=in_range, other=0.0
        )
        absmax = tl.load(nested_code_ptr + nested_codes) * nested_scale + tl.load(nested_offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + blocks, mask=in_range, other=0.0)
    w = tl.reshape(tl.reshape(values, (BLOCKS, BLOCKSIZE)) * absmax[:, None], (BLOCK,))
    offs = start + tl.arange(0, BLOCK)
    out = cast_out(w, out_ptr.dtype.element_ty, INTERPRET)
    if EVEN:
        tl.store(out_ptr + offs, out)
    else:
        tl.store(out_ptr + offs, out, mask=offs < numel)


@triton.jit
@no_type_check
def _bnb_int8_kernel(
    q_ptr, scb_ptr, out_ptr, N, K, stride_qn, stride_qk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """A ``[BLOCK_N, BLOCK_K]`` tile of ``q * SCB[:, None] * (1/127)``."""
    row_tile, k_tile = k_first_tile(K, BLOCK_K)
    offs_n = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_tile.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    q = tl.load(
        q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk, mask=mask, other=0
    )
    scb = tl.load(scb_ptr + offs_n, mask=offs_n < N, other=0.0)
    w = q.to(tl.float32) * scb[:, None] * _INT8_RECIPROCAL_C
    out = cast_out(w, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], out, mask=mask)


def _checked(
    payload: QuantPayload, name: str, value: Tensor | None, dtype: torch.dtype, shape: tuple
) -> Tensor:
    """``value`` after checking presence, dtype and shape (values are checked separately)."""
    tensor = require_tensor(value, name, payload)
    require_dtype(tensor, name, (dtype,), payload)
    require_shape(tensor, name, shape, payload)
    return tensor


def _require_all_finite(payload: QuantPayload, tensors: dict[str, Tensor]) -> None:
    """Raise the codec's error for the first non-finite tensor; one device sync in all."""
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()])
    if not bool(finite.all()):
        for name, tensor in tensors.items():
            require_finite(tensor, name, payload)


def _nested_extras(payload: QuantPayload, n_blocks: int) -> tuple[dict[str, Tensor], int]:
    """The float32 nested statistics of a uint8-absmax payload and their block size."""
    nested_blocksize = payload.layout.get("nested_blocksize")
    if not isinstance(nested_blocksize, int) or nested_blocksize <= 0:
        raise ValueError(
            "a nested bitsandbytes payload (uint8 scales) needs layout['nested_blocksize'] "
            f"(a positive int), got {nested_blocksize!r}"
        )
    shapes = {
        "nested_absmax": (ceil_div(n_blocks, nested_blocksize),),
        "nested_code": (256,),
        "nested_offset": (),
    }
    tensors = {
        f"extra.{key}": _checked(
            payload, f"extra.{key}", payload.extras.get(key), torch.float32, shape
        ).contiguous()
        for key, shape in shapes.items()
    }
    return tensors, nested_blocksize


def _dequantize_4bit(
    payload: QuantPayload, dtype: torch.dtype, launch: DequantLaunch | None, check_values: bool
) -> Tensor:
    numel = payload.numel
    blocksize = int(payload.format.block[1])
    if blocksize not in BNB_BLOCKSIZES:
        raise ValueError(f"bitsandbytes blocksize must be one of {BNB_BLOCKSIZES}, got {blocksize}")
    packed = _checked(payload, "data", payload.data, torch.uint8, (ceil_div(numel, 2), 1))
    code = _checked(payload, "extra.code", payload.extras.get("code"), torch.float32, (16,))
    n_blocks = ceil_div(numel, blocksize)
    scales = require_tensor(payload.scales, "scales", payload)
    nested = scales.dtype == torch.uint8
    absmax = _checked(payload, "scales", scales, scales.dtype if nested else torch.float32,
                      (n_blocks,)).contiguous()  # fmt: skip
    floats = {"extra.code": code.contiguous()}
    if nested:
        nested_tensors, nested_blocksize = _nested_extras(payload, n_blocks)
        floats.update(nested_tensors)
        statistics = tuple(nested_tensors.values())
    else:
        floats["scales"] = absmax
        nested_blocksize, statistics = 1, (absmax, absmax, absmax)  # unread placeholders
    if check_values:
        _require_all_finite(payload, floats)
    out = torch.empty(payload.shape, dtype=dtype, device=packed.device)
    if numel == 0:
        return out
    tile = launch or (INTERPRETER_4BIT_LAUNCH if interpreting() else GPU_4BIT_LAUNCH)
    block = max(tile.block_n * tile.block_k, blocksize)  # whole absmax blocks
    with on_device(out.device):
        _bnb_4bit_kernel[(ceil_div(numel, block),)](
            packed.reshape(-1), floats["extra.code"], absmax, *statistics, out, numel,
            BLOCKSIZE=blocksize, NESTED=nested, NESTED_BLOCKSIZE=nested_blocksize, BLOCK=block,
            EVEN=numel % block == 0,
            INTERPRET=interpreting(), num_warps=tile.num_warps, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _dequantize_int8(
    payload: QuantPayload, dtype: torch.dtype, launch: DequantLaunch | None, check_values: bool
) -> Tensor:
    if len(payload.shape) != 2:
        raise ValueError(f"bnb_int8 payload shape must be [out, in], got {list(payload.shape)}")
    n, k = (int(s) for s in payload.shape)
    q = _checked(payload, "data", payload.data, torch.int8, (n, k))
    scb = _checked(payload, "scales", payload.scales, torch.float32, (n,)).contiguous()
    if check_values:
        _require_all_finite(payload, {"scales": scb})
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    if out.numel() == 0:
        return out
    tile = launch or (INTERPRETER_INT8_LAUNCH if interpreting() else GPU_INT8_LAUNCH)
    with on_device(out.device):
        _bnb_int8_kernel[k_first_grid(n, k, tile.block_n, tile.block_k)](
            q, scb, out, n, k, q.stride(0), q.stride(1), BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k, INTERPRET=interpreting(), num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


def dequantize_bnb_triton(
    payload: QuantPayload,
    dtype: torch.dtype = torch.bfloat16,
    *,
    launch: DequantLaunch | None = None,
    check_values: bool = True,
) -> Float[Tensor, "..."]:
    """Dense weight of a ``bnb_nf4``/``bnb_fp4``/``bnb_int8`` payload, decoded by a Triton kernel.

    Bit-exact with ``qlens.dequantize(payload, dtype)`` for float32, bfloat16 and float16.
    ``launch``: an int8 program decodes ``block_n`` rows by ``block_k`` columns; a 4-bit one
    ``block_n * block_k`` consecutive elements of the flattened weight (at least one absmax
    block). ``None`` takes ``GPU_INT8_LAUNCH`` / ``GPU_4BIT_LAUNCH``.
    ``check_values`` raises the codec's error for non-finite scales or maps (one device sync);
    ``False`` skips it (no sync: forward passes, CUDA graphs) and NaNs then flow into the weight.
    """
    if payload.format.name not in BNB_FORMATS:
        raise ValueError(
            f"dequantize_bnb_triton reads the formats {list(BNB_FORMATS)}, not "
            f"{payload.format.name!r}; use qlens.kernels.dequantize_triton or qlens.dequantize"
        )
    if dtype not in _OUT_DTYPES:
        raise ValueError(
            f"dequantize_bnb_triton outputs {list(_OUT_DTYPES)}, not {dtype}; use "
            "qlens.dequantize for other dtypes"
        )
    require_kernel_device(payload.data.device)
    require_same_device(payload)
    if payload.format.name == "bnb_int8":
        return _dequantize_int8(payload, dtype, launch, check_values)
    return _dequantize_4bit(payload, dtype, launch, check_values)
