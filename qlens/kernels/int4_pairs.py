"""Tensor-core GEMV for int4 weights with the codes decoded two at a time (1 to 16 rows).

On the GPU one inline-assembly block turns two int32 words (16 codes) into eight registers of
two 16-bit floats each: a byte-permute gathers the same byte of both words, one ``lop3`` masks a
nibble of each half and ors in the exponent of ``BIAS`` (bf16 128, fp16 1024, whose unit in the
last place is 1), so each half is the float ``BIAS + q`` exactly, and one packed subtraction of
``BIAS + zero`` leaves ``q - zero``, still exact. That is about 1.5 instructions per code, against
about 4 for the float32 FMA GEMV, whose budget at the H200's bandwidth is the bottleneck.

The codes, multiplied on tensor cores with ``x`` in its own dtype and summed in float32, are
scaled once per 128-wide K sub-tile (a sub-tile lies in one scale group), so every product is
exact and the scale is applied in float32. Within a sub-tile the 16 words are taken in the
order of the tensor cores' operand fragments (``_fragment_order``; ``x`` is stored in it by
the regrouping launch): with it the decoded registers already sit where the dot wants them (no shuffles in the
sm_90 code). ``x`` arrives regrouped by code position (``qlens.kernels.gemv.permute_codes``).
The interpreter runs the same bit decode in float32, one code at a time.
"""

from typing import no_type_check

import torch
import triton
import triton.language as tl

from qlens.kernels.decode_fast import _load_words
from qlens.kernels.splits import store_tile

SUBTILE_K = 128  # K per sub-tile: 16 words, one scale group (group sizes are multiples of it)
BIAS = {torch.bfloat16: 128.0, torch.float16: 1024.0}
_MAGIC = {torch.bfloat16: 0x43004300, torch.float16: 0x64006400}  # BIAS in both halves
_PTX_TYPE = {torch.bfloat16: "bf16x2", torch.float16: "f16x2"}
_LOP3_AND_OR = 0xEA  # lop3 truth table of (a & b) | c
_SUBTILE_C = tl.constexpr(SUBTILE_K)
_WORDS_C = tl.constexpr(SUBTILE_K // 8)


def pair_decode_asm(dtype: torch.dtype) -> str:
    """PTX: words ``$8``, ``$9`` and ``BIAS + 8`` pairs ``$10`` -> ``$j`` = (code ``j`` of
    ``$8``, code ``j`` of ``$9``) minus 8, as two ``dtype`` values (``j < 8``)."""
    lines = ["{", ".reg .b32 t, u, v;"]
    for byte in range(4):
        lines.append(f"prmt.b32 t, $8, $9, {byte | (4 + byte) << 8:#x};")  # bytes 0, 2
        for nibble, src in ((0, "t"), (1, "u")):
            if nibble:
                lines.append("shr.u32 u, t, 4;")
            lines += [
                f"lop3.b32 v, {src}, 0x000F000F, {_MAGIC[dtype]:#010x}, {_LOP3_AND_OR:#x};",
                f"sub.{_PTX_TYPE[dtype]} ${2 * byte + nibble}, v, $10;",
            ]
    return "\n".join([*lines, "}"])


_BF16_ASM = tl.constexpr(pair_decode_asm(torch.bfloat16))
_FP16_ASM = tl.constexpr(pair_decode_asm(torch.float16))
_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r")  # 8 pairs out; 2 words, 1 pair in
_BF16_BIAS = tl.constexpr(BIAS[torch.bfloat16])
_FP16_BIAS = tl.constexpr(BIAS[torch.float16])


def fragment_order_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s last dimension (16 words) in ``_fragment_order``: how ``x`` is stored for the dot."""
    return t.reshape(*t.shape[:-1], 4, 2, 2).transpose(-3, -2).reshape(t.shape)


@triton.jit
@no_type_check
def _fragment_order(t, ROWS: tl.constexpr):
    """The 16 words of a sub-tile reordered so that logical word ``8b + 2a + c`` is physical word
    ``4a + 2b + c``: each thread's four loaded words become the K pairs ``(2a, 2a + 1)`` and
    ``(2a + 8, 2a + 9)`` of an ``m16n8k16`` fragment. Applied to both operands of the dot."""
    return tl.reshape(tl.permute(tl.reshape(t, (ROWS, 4, 2, 2)), (0, 2, 1, 3)), (ROWS, 16))


@triton.jit
@no_type_check
def _decoded(words, bias_pairs, X_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Per-tile decode state: the asm's eight ``q - zero`` tensors, or the words (interpreter)."""
    if USE_ASM:
        if X_DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(
                _BF16_ASM, _CONSTRAINTS, [words, bias_pairs], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=2,
            )  # fmt: skip
        else:
            return tl.inline_asm_elementwise(
                _FP16_ASM, _CONSTRAINTS, [words, bias_pairs], dtype=(tl.float16,) * 8,
                is_pure=True, pack=2,
            )  # fmt: skip
    else:
        return words


@triton.jit
@no_type_check
def _code(state, J: tl.constexpr, USE_ASM: tl.constexpr):
    """Code ``J`` of every word minus 8 (exact in the activations' dtype)."""
    if USE_ASM:
        return state[J]
    else:
        return ((state >> (4 * J)) & 0xF).to(tl.float32) - 8.0


@triton.jit
@no_type_check
def _subtile(
    acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, offs_m, offs_n, k0, M, N, K,
    stride_xm, stride_xj, stride_w, stride_s,
    GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_K: tl.constexpr, MASK_N: tl.constexpr, X_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """``acc[m, n] += scale[n] * sum_k (q[n, k] - zero[n]) x[m, k]`` over ``k0 .. k0 + 128``."""
    offs_w = (tl.arange(0, _WORDS_C) + k0 // 8)[None, :]  # tensor first: k0 may be a constexpr
    n_ok = offs_n < N
    words = _load_words(words_ptr, offs_n[:, None] * stride_w, n_ok[:, None], offs_w, K, MASK_K,
                        MASK_N)  # fmt: skip
    group = k0 // GROUP_K
    scale = tl.load(scale_ptr + offs_n * stride_s + group, mask=n_ok, other=1.0).to(tl.float32)
    if X_DTYPE == tl.bfloat16:
        bias = tl.full((BLOCK_N, _WORDS_C), _BF16_BIAS + 8, tl.bfloat16)
    else:
        bias = tl.full((BLOCK_N, _WORDS_C), _FP16_BIAS + 8, tl.float16)
    state = _decoded(words, bias, X_DTYPE, USE_ASM)
    x_ptrs = xp_ptr + offs_m[:, None] * stride_xm + offs_w
    x_mask = (offs_m < M)[:, None] & (offs_w < stride_xj)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_sum = tl.zeros((BLOCK_M, _WORDS_C), dtype=tl.float32)
    for j in tl.static_range(8):
        x = tl.load(x_ptrs + j * stride_xj, mask=x_mask, other=0.0)  # already in fragment order
        w = _fragment_order(_code(state, j, USE_ASM), BLOCK_N)
        if HAS_ZEROS:
            x_sum += x.to(tl.float32)
        if USE_ASM:
            part = tl.dot(x, tl.trans(w), part)
        else:  # the interpreter multiplies 16-bit floats as bit patterns: compute in float32
            part = tl.dot(x.to(tl.float32), tl.trans(w), part, input_precision="ieee")
    if HAS_ZEROS:
        # The codes were offset by 8; sum (q - z) x = sum (q - 8) x - (z - 8) sum x.
        zero = tl.load(zero_ptr + offs_n * stride_s + group, mask=n_ok, other=8)
        shift = zero.to(tl.float32) - 8.0
        part -= tl.sum(x_sum, axis=1)[:, None] * shift[None, :]
    return acc + part * scale[None, :]


@triton.jit
@no_type_check
def int4_pairs_kernel(
    xp_ptr, words_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_xm, stride_xj, stride_w, stride_s, stride_om, stride_split,
    GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, X_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
    INTERPRET: tl.constexpr, LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` output columns of ``BLOCK_M`` rows over one K split, ``BLOCK_K``
    (a multiple of 128) per loop step; a K tail shorter than a step runs sub-tile by sub-tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    k_full = tl.maximum(k_begin, k_end - k_end % BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_full, BLOCK_K, num_stages=LOOP_STAGES):
        for t in tl.static_range(BLOCK_K // _SUBTILE_C):
            acc = _subtile(
                acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, offs_m, offs_n, k0 + t * _SUBTILE_C,
                M, N, K, stride_xm, stride_xj, stride_w, stride_s, GROUP_K, HAS_ZEROS, BLOCK_M,
                BLOCK_N, False, MASK_N, X_DTYPE, USE_ASM,
            )  # fmt: skip
    for k0 in range(k_full, k_end, _SUBTILE_C):
        acc = _subtile(
            acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, offs_m, offs_n, k0, M, N, K,
            stride_xm, stride_xj, stride_w, stride_s, GROUP_K, HAS_ZEROS, BLOCK_M, BLOCK_N, True,
            True,
            X_DTYPE, USE_ASM,
        )  # fmt: skip
    store_tile(acc, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
               stride_split, pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip
