"""Few-row (M <= 16) weight-only GEMV for packed 4-bit weights (int4, MXFP4, NVFP4).

The packed weight is read as int32 words of eight codes (16-byte vector loads, no K mask on the
hot loop) and every code is decoded in a few integer operations:

- int4: ``code | 0x4B000000`` read as float32 is ``2**23 + code``; one subtraction of
  ``2**23 + zero`` (8 when symmetric) gives the exact integer.
- E2M1: the three magnitude bits go to bits 11..9 and the sign to bit 15 of an fp16, which is
  then exactly ``value * 2**-14``. On the GPU one inline-assembly block turns a word into eight
  such fp16 values, two per 32-bit register; the interpreter runs the same bit operations one
  code at a time. The factor ``2**14`` is applied with the group scale.

Each code meets all M activation rows in float32 FMAs; the products of one tile are summed per
word and multiplied by the group scale once per word instead of once per code.
"""

from typing import no_type_check

import triton
import triton.language as tl

from qlens.kernels.decode import INT4_C, _expand, _group_values, _scales, _tile_groups
from qlens.kernels.numerics import cast_out

# Per register pair p (codes p and p + 4 of a word): left shifts (negative: right) that move the
# magnitude bits to fp16 bits 11..9 and the sign to bit 15 of each 16-bit half.
E2M1_PAIR_SHIFTS: tuple[tuple[int, int], ...] = tuple((9 - 4 * p, 12 - 4 * p) for p in range(4))
E2M1_MAGNITUDE_MASK = 0x0E000E00
E2M1_SIGN_MASK = 0x80008000
E2M1_FP16_FACTOR = 16384.0  # E2M1 value = fp16 value * 2**14
INT4_MAGIC_BITS = 0x4B000000  # float32 2**23

_MAGNITUDE_C = tl.constexpr(E2M1_MAGNITUDE_MASK)
_SIGN_C = tl.constexpr(E2M1_SIGN_MASK)
_FACTOR_C = tl.constexpr(E2M1_FP16_FACTOR)
_INT4_MAGIC_C = tl.constexpr(INT4_MAGIC_BITS)


def _shift_ptx(dst: str, src: str, amount: int) -> str:
    if amount >= 0:
        return f"shl.b32 {dst}, {src}, {amount};"
    return f"shr.u32 {dst}, {src}, {-amount};"


def e2m1_word_asm() -> str:
    """PTX turning one int32 word (operand ``$8``) into eight float32 codes ``$0..$7``."""
    lines = ["{", ".reg .b32 a, b, r;", ".reg .b16 lo, hi;"]
    for p, (mag_shift, sign_shift) in enumerate(E2M1_PAIR_SHIFTS):
        lines += [
            _shift_ptx("a", "$8", mag_shift),
            _shift_ptx("b", "$8", sign_shift),
            f"and.b32 a, a, {E2M1_MAGNITUDE_MASK:#010x};",
            f"and.b32 b, b, {E2M1_SIGN_MASK:#010x};",
            "or.b32 r, a, b;",
            "mov.b32 {lo, hi}, r;",
            f"cvt.f32.f16 ${p}, lo;",
            f"cvt.f32.f16 ${p + 4}, hi;",
        ]
    return "\n".join([*lines, "}"])


E2M1_WORD_ASM = tl.constexpr(e2m1_word_asm())


@triton.jit
@no_type_check
def _shift(w, AMOUNT: tl.constexpr):
    """Logical shift of uint32 ``w`` left by ``AMOUNT`` (right when negative)."""
    if AMOUNT >= 0:
        return w << AMOUNT
    else:
        return w >> (-AMOUNT)


@triton.jit
@no_type_check
def _e2m1_code(words, J: tl.constexpr):
    """float32 ``value * 2**-14`` of code ``J`` of each uint32 word (the asm's bit operations)."""
    P: tl.constexpr = J % 4
    pair = (_shift(words, 9 - 4 * P) & _MAGNITUDE_C) | (_shift(words, 12 - 4 * P) & _SIGN_C)
    half = (pair >> (16 * (J // 4))) & 0xFFFF
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
@no_type_check
def _accumulate_tile(
    acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N, K,
    stride_xm, stride_w, stride_s,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, MASK_M: tl.constexpr, MASK_N: tl.constexpr,
    USE_ASM: tl.constexpr,
):  # fmt: skip
    """``acc[m, n, i] += sum_j W[n, k0 + 8i + j] * x[m, k0 + 8i + j]`` for one K tile.

    Every operand is read in the product's own ``[M, N, words]`` shape (``x`` repeated along N,
    served by L1), so no layout exchange through shared memory is needed inside the code loop.
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_w = (k0 // 8 + tl.arange(0, WORDS))[None, None, :]
    n3 = offs_n[None, :, None]
    w_ptrs = words_ptr + n3 * stride_w + offs_w
    if MASK_K:
        words = tl.load(w_ptrs, mask=(n3 < N) & (offs_w * 8 < K), other=0)
    elif MASK_N:
        words = tl.load(w_ptrs, mask=n3 < N, other=0)
    else:
        words = tl.load(w_ptrs)
    words = words.to(tl.uint32, bitcast=True)
    n_groups = tl.cdiv(K, GROUP_K)
    groups = _tile_groups(k0, GROUP_K, BLOCK_K)
    RUN: tl.constexpr = GROUP_K // 8
    SEVERAL: tl.constexpr = BLOCK_K > GROUP_K
    scale = _expand(
        _scales(scale_ptr, global_ptr, offs_n, groups, N, n_groups, stride_s, FAMILY, 1,
                SCALE_E8M0, GLOBAL_DIVIDE),
        BLOCK_N, WORDS, RUN, SEVERAL,
    )[None, :, :]  # fmt: skip
    if FAMILY == INT4_C:
        if HAS_ZEROS:
            z = _group_values(zero_ptr, offs_n, groups, N, n_groups, stride_s, 1, 0)
            zero = _expand(z.to(tl.float32), BLOCK_N, WORDS, RUN, SEVERAL)[None, :, :]
        else:
            zero = 8.0
        marked = (words | _INT4_MAGIC_C, (words >> 16) | _INT4_MAGIC_C)
    elif USE_ASM:
        codes = tl.inline_asm_elementwise(
            E2M1_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r", [words], dtype=(tl.float32,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    # x arrives regrouped in quads of words: xp[m, q, j, r] = x[m, 8 * (4q + r) + j], so each
    # thread's four words read their activations of code j with one 16-byte load.
    x_ptrs = xp_ptr + offs_m[:, None, None] * stride_xm + (offs_w // 4) * 32 + offs_w % 4 + 0 * n3
    if MASK_K:
        x_mask = (offs_m < M)[:, None, None] & (offs_w < stride_xm // 8) & (n3 >= 0)
    else:
        x_mask = (offs_m < M)[:, None, None] & (n3 >= 0)
    for j in tl.static_range(8):
        if MASK_K or MASK_M:
            x = tl.load(x_ptrs + 4 * j, mask=x_mask, other=0.0)
        else:
            x = tl.load(x_ptrs + 4 * j)
        if FAMILY == INT4_C:
            # Code j sits at bits 4 * (j % 4) of the word (after a shift by 16 for the upper
            # four); with the magic bits set, the float below is 2**23 + code * 16**(j % 4), and
            # x carries 16**-(j % 4).
            field = marked[j // 4] & (_INT4_MAGIC_C | (0xF << (4 * (j % 4))))
            w = field.to(tl.float32, bitcast=True) - (8388608.0 + zero * (1 << (4 * (j % 4))))
        elif USE_ASM:
            w = codes[j]
        else:
            w = _e2m1_code(words, j)
        if j == 0:
            part = w * x
        else:
            part += w * x
    if FAMILY == INT4_C:
        return acc + part * scale
    else:
        return acc + (part * _FACTOR_C) * scale


@triton.jit
@no_type_check
def packed_gemv_kernel(
    xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_w, stride_s, stride_om, stride_split,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_M: tl.constexpr,
    MASK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` output columns of ``BLOCK_M`` rows over one K split."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    k_full = tl.maximum(k_begin, k_end - k_end % BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    for k0 in range(k_begin, k_full, BLOCK_K):
        acc = _accumulate_tile(
            acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N, K,
            stride_xm, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE,
            BLOCK_N, BLOCK_K, False, MASK_M, MASK_N, USE_ASM,
        )  # fmt: skip
    if k_full < k_end:
        acc = _accumulate_tile(
            acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_full, M, N,
            K, stride_xm, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, True, True, True, USE_ASM,
        )  # fmt: skip
    total = tl.sum(acc, axis=2)
    n_ok = offs_n < N
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = cast_out(total, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)
    else:
        partial = out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(partial, total, mask=mask)
