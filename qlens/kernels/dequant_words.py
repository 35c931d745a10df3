"""Dequantize packed 4-bit weights (int4, MXFP4, NVFP4) read as int32 words of eight codes.

The codes are decoded as in the word-wise GEMV (``qlens.kernels.decode_fast``): 16-byte word
loads and a few integer operations per code, exact. The eight code positions are joined back
into the row's order in registers, so each thread writes its words' 32 outputs contiguously.
Bit-exact with ``qlens.dequantize``: every value is ``code * scale`` rounded once to the output
dtype, as the codecs compute it.
"""

from typing import no_type_check

import torch
import triton
import triton.language as tl

from qlens.kernels.decode import INT4_C
from qlens.kernels.decode_fast import _FACTOR_C, _code, _code_values, _load_words, _word_scales
from qlens.kernels.launch import kernel_args
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import interpreting
from qlens.kernels.weights import KernelWeight
from qlens.quant.codecs.checks import ceil_div


@triton.jit
@no_type_check
def _scaled_code(state, zero, scale, J: tl.constexpr, FAMILY: tl.constexpr, USE_ASM: tl.constexpr):
    """float32 ``W`` of code position ``J`` of every word."""
    if FAMILY == INT4_C:
        return _code(state, zero, J, FAMILY, USE_ASM) * scale
    else:
        return (_code(state, zero, J, FAMILY, USE_ASM) * _FACTOR_C) * scale


@triton.jit
@no_type_check
def _in_row_order(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """``[BLOCK_N, 8 * WORDS]`` from the ``[BLOCK_N, WORDS]`` values of each code position.

    ``tl.join`` adds a last axis; after three joins, index ``(p, q, r)`` holds code
    ``4p + 2q + r``, so the flattened last axes are the row's order."""
    even = tl.join(tl.join(c0, c4), tl.join(c2, c6))
    odd = tl.join(tl.join(c1, c5), tl.join(c3, c7))
    return tl.reshape(tl.join(even, odd), (BLOCK_N, 8 * WORDS))


@triton.jit
@no_type_check
def dequant_words_kernel(
    words_ptr, scale_ptr, zero_ptr, global_ptr, out_ptr, N, K, stride_w, stride_s, stride_o,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, MASK_N: tl.constexpr, USE_ASM: tl.constexpr,
    WORD_RUN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: ``W[n0:n0 + BLOCK_N, k0:k0 + BLOCK_K]`` in ``out``'s dtype."""
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_w = (k0 // 8 + tl.max_contiguous(tl.arange(0, WORDS), WORD_RUN))[None, :]
    n_ok = (offs_n < N)[:, None]
    words = _load_words(words_ptr, offs_n[:, None] * stride_w, n_ok, offs_w, K, MASK_K, MASK_N)
    scale, zero = _word_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_s,
                               FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N,
                               BLOCK_K)  # fmt: skip
    state = _code_values(words, FAMILY, USE_ASM)
    w = _in_row_order(
        _scaled_code(state, zero, scale, 0, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 1, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 2, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 3, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 4, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 5, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 6, FAMILY, USE_ASM),
        _scaled_code(state, zero, scale, 7, FAMILY, USE_ASM),
        BLOCK_N, WORDS,
    )  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + offs_n[:, None] * stride_o + offs_k[None, :]
    value = cast_out(w, out_ptr.dtype.element_ty, INTERPRET)
    if MASK_K:
        tl.store(out_ptrs, value, mask=n_ok & (offs_k < K)[None, :])
    elif MASK_N:
        tl.store(out_ptrs, value, mask=n_ok)
    else:
        tl.store(out_ptrs, value)


def dequantize_words(
    w: KernelWeight, words: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int,
    num_warps: int, word_run: int = 4,
) -> None:  # fmt: skip
    """Write ``w`` (its packed data viewed as int32 ``words``) into ``out`` ``[n, k]``."""
    _, scales, zeros, global_scale = kernel_args(w)
    interpret = interpreting()
    dequant_words_kernel[(ceil_div(w.n, block_n), ceil_div(w.k, block_k))](
        words, scales, zeros, global_scale, out, w.n, w.k, words.stride(0), scales.stride(0),
        out.stride(0), FAMILY=w.family, GROUP_K=w.group_k, SCALE_E8M0=w.scale_e8m0,
        HAS_ZEROS=w.zeros is not None, GLOBAL_DIVIDE=w.global_divide, BLOCK_N=block_n,
        BLOCK_K=block_k, WORD_RUN=word_run, MASK_K=w.k % block_k != 0, MASK_N=w.n % block_n != 0,
        USE_ASM=not interpret, INTERPRET=interpret, num_warps=num_warps,
    )  # fmt: skip
