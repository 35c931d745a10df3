"""Weight-only GEMV for packed 4-bit weights (int4, MXFP4, NVFP4, bitsandbytes NF4/FP4) and a
few rows of ``x``.

The packed weight is read as int32 words of eight codes (16-byte vector loads, no K mask on the
hot loop) and every code is decoded exactly in a few integer operations:

- int4: with ``0x4B000000`` (float32 ``2**23``) or-ed into the word, masking one code leaves
  the float ``2**23 + code * 16**i`` (``i`` its nibble within a half word); one FMA scales and
  subtracts it to ``code - zero``.
- E2M1: the three magnitude bits go to bits 11..9 and the sign to bit 15 of an fp16, which is
  then exactly ``value * 2**-14``. On the GPU one inline-assembly block turns a word into eight
  such values, two per 32-bit register; the interpreter runs the same bit operations one code
  at a time. The factor ``2**14`` is applied with the group scale.
- bitsandbytes (``BNB4``): each code (the even one of a byte in its high nibble) indexes the
  16-entry float32 table, one load from L1 a code.

For one row each code meets ``x`` in float32 FMAs; the products of a quad of words (below) are
summed in two chains, words 0-1 and 2-3, and multiplied by their group scale once per quad
(groups of 32 or more) or per chain (groups of 16), not once per code or word. A row read as the
caller holds it (any float dtype, so a call launches nothing but the GEMV) is tiled as quads of
words: each thread loads four consecutive words of a weight row (16 bytes) and the 32
activations they meet (four 16-byte loads, split into the eight code positions in registers),
and both tiles put a quad's word ``c`` in the same register of the same thread, so decoded codes
meet their activations without crossing shared memory and every thread reuses its activations
for all its rows. For two rows or more the decoded, scaled codes feed tensor-core dots, one
per code position (an ``[M, N, words]`` FMA product for 2-4 rows ran far slower,
``benchmarks/results/archive/gemv_registers_h200.md``), on ``x`` regrouped by code position.
"""

from typing import no_type_check

import triton
import triton.language as tl

from qlens.kernels.decode import (
    BNB4_C,
    INT4_C,
    _expand,
    _group_values,
    _scales,
    _tile_groups,
    scale_values,
)
from qlens.kernels.splits import store_tile, sum_tile_splits
from qlens.kernels.weight_only import _dot_acc

# Per register pair p (codes p and p + 4 of a word): left shifts (negative: right) that move the
# magnitude bits to fp16 bits 11..9 and the sign to bit 15 of each 16-bit half.
E2M1_PAIR_SHIFTS: tuple[tuple[int, int], ...] = tuple((9 - 4 * p, 12 - 4 * p) for p in range(4))
E2M1_MAGNITUDE_MASK = 0x0E000E00
E2M1_SIGN_MASK = 0x80008000
E2M1_FP16_FACTOR = 16384.0  # E2M1 value = fp16 value * 2**14
INT4_MAGIC_BITS = 0x4B000000  # float32 2**23


def quads_lead(version: str = triton.__version__) -> bool:
    """Whether the quads of words lead the dimensions of a one-row tile read as it is.

    Triton's coalescing hands the lanes of a load to its non-contiguous dimensions in index
    order up to 3.6 and in reverse order from 3.7 (sm_90 compiles of 3.6.0, 3.7.1, 3.8.0 and
    3.9.0): the quads must come first for the former and last for the latter, so that a quad's
    words and activations stay in one thread and no decoded tile crosses shared memory."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) < (3, 7)


QUADS_LEAD = tl.constexpr(quads_lead())
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
def _load_words(words_ptr, rows, n_ok, offs_w, K, MASK_K: tl.constexpr, MASK_N: tl.constexpr):
    """uint32 words at row offsets ``rows`` and word indices ``offs_w`` (2-D or 3-D tensors)."""
    w_ptrs = words_ptr + rows + offs_w
    if MASK_K:
        words = tl.load(w_ptrs, mask=n_ok & (offs_w * 8 < K), other=0)
    elif MASK_N:
        words = tl.load(w_ptrs, mask=n_ok, other=0)
    else:
        words = tl.load(w_ptrs)
    return words.to(tl.uint32, bitcast=True)


@triton.jit
@no_type_check
def _word_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_s,
                 FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """float32 scale and zero point ``[BLOCK_N, BLOCK_K / 8]`` of each word of a K tile (the
    zero point is the constant 8 without zero points)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    RUN: tl.constexpr = GROUP_K // 8
    SEVERAL: tl.constexpr = BLOCK_K > GROUP_K
    n_groups = tl.cdiv(K, GROUP_K)
    groups = _tile_groups(k0, GROUP_K, BLOCK_K)
    scale = _expand(
        _scales(scale_ptr, global_ptr, offs_n, groups, N, n_groups, stride_s, FAMILY, 1,
                SCALE_E8M0, GLOBAL_DIVIDE),
        BLOCK_N, WORDS, RUN, SEVERAL,
    )  # fmt: skip
    if HAS_ZEROS:
        z = _group_values(zero_ptr, offs_n, groups, N, n_groups, stride_s, 1, 0)
        return scale, _expand(z.to(tl.float32), BLOCK_N, WORDS, RUN, SEVERAL)
    else:
        return scale, 8.0  # the symmetric int4 offset, folded into a constant


@triton.jit
@no_type_check
def _code_values(words, FAMILY: tl.constexpr, USE_ASM: tl.constexpr):
    """Per-word state the eight code decodes share: magic-marked words (int4), the words
    (bitsandbytes' codes, looked up one by one) or the asm's codes."""
    if FAMILY == INT4_C:
        return (words | _INT4_MAGIC_C, (words >> 16) | _INT4_MAGIC_C)
    elif FAMILY == BNB4_C:
        return words
    elif USE_ASM:
        return tl.inline_asm_elementwise(
            E2M1_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r", [words], dtype=(tl.float32,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return words


@triton.jit
@no_type_check
def _code(state, zero, table_ptr, J: tl.constexpr, FAMILY: tl.constexpr, USE_ASM: tl.constexpr):
    """Code ``J`` of every word: int4 ``q - zero``, E2M1 ``value * 2**-14`` (exact), bitsandbytes'
    ``table[q]`` (code ``J`` in byte ``J // 2``, the even one in the high nibble)."""
    if FAMILY == BNB4_C:
        SHIFT: tl.constexpr = 8 * (J // 2) + 4 * (1 - J % 2)
        return tl.load(table_ptr + ((state >> SHIFT) & 0xF).to(tl.int32))
    elif FAMILY == INT4_C:
        # Code J sits at bits 4 * (J % 4) of the word (after a shift by 16 for the upper four);
        # with the magic bits set the float is 2**23 + q * 16**(J % 4), and one FMA scales it
        # by 16**-(J % 4) and subtracts 2**(23 - 4 * (J % 4)) + zero, exactly.
        field = state[J // 4] & (_INT4_MAGIC_C | (0xF << (4 * (J % 4))))
        value = field.to(tl.float32, bitcast=True)
        return value * (1.0 / (1 << (4 * (J % 4)))) - ((1 << (23 - 4 * (J % 4))) + zero)
    elif USE_ASM:
        return state[J]
    else:
        return _e2m1_code(state, J)


@triton.jit
@no_type_check
def _quad_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k_word, N, K, stride_s,
                 FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr):  # fmt: skip
    """float32 scale and zero point (the constant 8 without zero points) of the words of rows
    ``offs_n`` at K offsets ``k_word`` (``[A, 1, B]``), as ``[A, BLOCK_N, B]``."""
    groups = k_word // GROUP_K
    rows = offs_n[None, :, None]
    mask = (rows < N) & (groups < tl.cdiv(K, GROUP_K))
    offsets = rows * stride_s + groups
    s = scale_values(scale_ptr, global_ptr, offsets, mask, FAMILY, SCALE_E8M0, GLOBAL_DIVIDE)
    if HAS_ZEROS:
        return s, tl.load(zero_ptr + offsets, mask=mask, other=0).to(tl.float32)
    else:
        return s, 8.0


@triton.jit
@no_type_check
def _pairs_to_quads(pairs, BLOCK_N: tl.constexpr, QUADS: tl.constexpr):
    """Per-pair values of a quad's words (``[Q, BLOCK_N, 2]`` or ``[2, BLOCK_N, Q]``) repeated
    for both words of each pair (``[Q, BLOCK_N, 4]`` or ``[4, BLOCK_N, Q]``)."""
    if QUADS_LEAD:
        wide = tl.broadcast_to(pairs[:, :, :, None], (QUADS, BLOCK_N, 2, 2))
        return tl.reshape(wide, (QUADS, BLOCK_N, 4))
    else:
        wide = tl.broadcast_to(pairs[:, None, :, :], (2, 2, BLOCK_N, QUADS))
        return tl.reshape(wide, (4, BLOCK_N, QUADS))


@triton.jit
@no_type_check
def _quad_major(t):
    """A quad tile (``[Q, B, C]`` with ``QUADS_LEAD``, else ``[C, B, Q]``) as ``[Q, B, C]``."""
    if QUADS_LEAD:
        return t
    else:
        return tl.permute(t, (2, 1, 0))


@triton.jit
@no_type_check
def _word_slices(t):
    """Words 0-3 of each quad of a quad tile (``_quad_major``'s ``[Q, B, 4]``), four ``[Q, B]``."""
    t = _quad_major(t)
    even, odd = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))  # word 2 h + l by l
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
@no_type_check
def _true_scale(part, FAMILY: tl.constexpr):
    """A sum of decoded codes times their values: E2M1 codes decode to ``value * 2**-14``."""
    if FAMILY == INT4_C or FAMILY == BNB4_C:
        return part
    else:
        return part * _FACTOR_C


@triton.jit
@no_type_check
def _fma_quads(
    acc, x_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, N, K,
    stride_xm, stride_w, stride_s,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, MASK_N: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """``acc[q, n] += sum W[n, k] * x[m, k]`` over quad ``q`` of one K tile, for the row
    ``offs_m`` (``[1]``) of ``x`` as the caller holds it (code ``j`` of word ``w`` at
    ``8 w + j``, any float dtype), in FMAs on quads of words: word ``4 q + c`` of the tile and
    row ``n`` is element ``[q, n, c]`` (``QUADS_LEAD``) or ``[c, n, q]`` of the loaded tiles. A
    thread's quad is one 16-byte load of words and four of activations (``[.., 8]``, split into
    the eight code positions in registers), both in the same registers of the same thread. The
    products of words 0-1 and of words 2-3 of a quad run in two chains of FMAs, scaled once a
    quad (groups of 32 or more: the chains summed first) or once a chain (groups of 16)."""
    QUADS: tl.constexpr = BLOCK_K // 32
    if QUADS_LEAD:
        offs_q = tl.arange(0, QUADS)[:, None, None]
        offs_c = tl.arange(0, 4)[None, None, :]
        LEAD: tl.constexpr = QUADS
        LAST: tl.constexpr = 4
    else:
        offs_q = tl.arange(0, QUADS)[None, None, :]
        offs_c = tl.arange(0, 4)[:, None, None]
        LEAD: tl.constexpr = 4
        LAST: tl.constexpr = QUADS
    word = k0 // 8 + offs_q * 4 + offs_c  # [LEAD, 1, LAST]
    rows = offs_n[None, :, None]
    words = _load_words(words_ptr, rows * stride_w, rows < N, word, K, MASK_K, MASK_N)
    offs_x = word[:, :, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    x_row = x_ptr + offs_m[:, None, None, None] * stride_xm
    if MASK_K:
        x = tl.load(x_row + offs_x, mask=offs_x < K, other=0.0)
    else:
        x = tl.load(x_row + offs_x)
    x = x.to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (LEAD, 1, LAST, 4, 2)))  # j = 2a, 2a + 1
    e0, e1 = tl.split(tl.reshape(even, (LEAD, 1, LAST, 2, 2)))  # j in (0, 4), (2, 6)
    o0, o1 = tl.split(tl.reshape(odd, (LEAD, 1, LAST, 2, 2)))  # j in (1, 5), (3, 7)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    xs = (x0, x1, x2, x3, x4, x5, x6, x7)
    if GROUP_K >= 32:  # a quad of words lies in one group
        scale, zero = _quad_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k0 + offs_q * 32, N,
                                   K, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS,
                                   GLOBAL_DIVIDE)  # fmt: skip
        scale_lo = tl.reshape(_quad_major(scale), (QUADS, BLOCK_N))
        scale_hi = scale_lo
    else:  # groups of 16 (the kernels' least): words 0-1 and 2-3 of a quad, each read once
        if QUADS_LEAD:
            k_pair = k0 + offs_q * 32 + tl.arange(0, 2)[None, None, :] * 16  # [Q, 1, 2]
        else:
            k_pair = k0 + offs_q * 32 + tl.arange(0, 2)[:, None, None] * 16  # [2, 1, Q]
        scale, zero = _quad_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k_pair, N, K,
                                   stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS,
                                   GLOBAL_DIVIDE)  # fmt: skip
        scale_lo, scale_hi = tl.split(_quad_major(scale))
        if HAS_ZEROS:
            zero = _pairs_to_quads(zero, BLOCK_N, QUADS)
    # Two chains of FMAs a quad and row: words 0-1 (``lo``) and 2-3 (``hi``), one group each
    # when groups are 16 long.
    state = _code_values(words, FAMILY, USE_ASM)
    for j in tl.static_range(8):
        w0, w1, w2, w3 = _word_slices(_code(state, zero, global_ptr, j, FAMILY, USE_ASM))
        v0, v1, v2, v3 = _word_slices(xs[j])
        if j == 0:
            lo = w0 * v0
            hi = w2 * v2
        else:
            lo += w0 * v0
            hi += w2 * v2
        lo += w1 * v1
        hi += w3 * v3
    if GROUP_K >= 32:
        acc += _true_scale(lo + hi, FAMILY) * scale_lo
    else:
        acc += _true_scale(lo, FAMILY) * scale_lo
        acc += _true_scale(hi, FAMILY) * scale_hi
    return acc


@triton.jit
@no_type_check
def quads_k_range(
    x_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_begin, k_full, k_end,
    N, K, stride_xm, stride_w, stride_s,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, USE_ASM: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    """float32 ``[BLOCK_N]``: ``sum_k W[n, k] * x[m, k]`` over ``[k_begin, k_end)`` for the one
    row ``offs_m`` (``[1]``) of ``x`` as the caller holds it (``_fma_quads``): whole
    ``BLOCK_K`` steps up to ``k_full`` unmasked along K, then the masked rest."""
    acc = tl.zeros((BLOCK_K // 32, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_full, BLOCK_K, num_stages=LOOP_STAGES):
        acc = _fma_quads(
            acc, x_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, N, K,
            stride_xm, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE,
            BLOCK_N, BLOCK_K, False, MASK_N, USE_ASM,
        )  # fmt: skip
    if k_full < k_end:
        acc = _fma_quads(
            acc, x_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_full, N, K,
            stride_xm, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE,
            BLOCK_N, BLOCK_K, True, True, USE_ASM,
        )  # fmt: skip
    return tl.sum(acc, axis=0)


@triton.jit
@no_type_check
def _rows_by_code(x_ptr, offs_m, k0, M, K, stride_xm, BLOCK_K: tl.constexpr,
                  MASK_K: tl.constexpr):  # fmt: skip
    """Rows ``offs_m`` of ``x`` over ``[k0, k0 + BLOCK_K)`` as the caller holds them, split
    by code position in registers: eight ``[BLOCK_M, BLOCK_K / 8]``, the ``j``-th holding
    ``x[m, k0 + 8 w + j]`` (zero past ``M`` rows and ``K``)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if MASK_K:
        x = tl.load(ptrs, mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)
    else:
        x = tl.load(ptrs, mask=(offs_m < M)[:, None], other=0.0)
    rows: tl.constexpr = x.shape[0]
    WORDS: tl.constexpr = BLOCK_K // 8
    even, odd = tl.split(tl.reshape(x, (rows, WORDS, 4, 2)))  # j = 2a, 2a + 1
    e0, e1 = tl.split(tl.reshape(even, (rows, WORDS, 2, 2)))  # j in (0, 4), (2, 6)
    o0, o1 = tl.split(tl.reshape(odd, (rows, WORDS, 2, 2)))  # j in (1, 5), (3, 7)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
@no_type_check
def _dot_tile(
    acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N, K,
    stride_xm, stride_xj, stride_w, stride_s,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, MASK_N: tl.constexpr, USE_ASM: tl.constexpr,
    X_AS_IS: tl.constexpr, X_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``acc[m, n] += x[m, k0:k0 + BLOCK_K] @ W[n, k0:k0 + BLOCK_K]`` on tensor cores: one dot
    per code position ``j`` over the words of the tile; ``x`` comes regrouped in its dtype, or
    as the caller holds it (``X_AS_IS``: rows ``stride_xm`` apart, split by code position in
    registers)."""
    offs_w = (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
    words = _load_words(words_ptr, offs_n[:, None] * stride_w, (offs_n < N)[:, None], offs_w, K,
                        MASK_K, MASK_N)  # fmt: skip
    scale, zero = _word_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_s,
                               FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N,
                               BLOCK_K)  # fmt: skip
    state = _code_values(words, FAMILY, USE_ASM)
    if X_AS_IS:
        xs = _rows_by_code(xp_ptr, offs_m, k0, M, K, stride_xm, BLOCK_K, MASK_K)
    else:
        x_ptrs = xp_ptr + offs_m[:, None] * stride_xm + offs_w
        x_mask = (offs_m < M)[:, None] & (offs_w < stride_xj)
    for j in tl.static_range(8):
        if X_AS_IS:
            x = xs[j].to(X_DTYPE)
        else:
            x = tl.load(x_ptrs + j * stride_xj, mask=x_mask, other=0.0).to(X_DTYPE)
        w = _code(state, zero, global_ptr, j, FAMILY, USE_ASM)
        if FAMILY == INT4_C or FAMILY == BNB4_C:
            w = w * scale
        else:
            w = (w * _FACTOR_C) * scale
        acc = _dot_acc(x, w, acc, INTERPRET)
    return acc


@triton.jit
@no_type_check
def dot_k_range(
    acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_begin, k_full,
    k_end, M, N, K, stride_xm, stride_xj, stride_w, stride_s,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, USE_ASM: tl.constexpr,
    X_AS_IS: tl.constexpr, X_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``_dot_tile`` over ``[k_begin, k_end)``: whole ``BLOCK_K`` steps up to ``k_full``
    unmasked along K, then the masked rest."""
    for k0 in range(k_begin, k_full, BLOCK_K):
        acc = _dot_tile(
            acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N,
            K, stride_xm, stride_xj, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, False, MASK_N, USE_ASM, X_AS_IS, X_DTYPE, INTERPRET,
        )  # fmt: skip
    if k_full < k_end:
        acc = _dot_tile(
            acc, xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_full, M,
            N, K, stride_xm, stride_xj, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0,
            HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, True, True, USE_ASM, X_AS_IS, X_DTYPE,
            INTERPRET,
        )  # fmt: skip
    return acc


@triton.jit
@no_type_check
def packed_gemv_kernel(
    xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, out_ptr, partial_ptr, ids_ptr,
    counter_ptr, M, N, K, stride_xm, stride_xj, stride_w, stride_s, stride_om, stride_split,
    stride_we, stride_se, stride_ge,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MASK_N: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_SUM: tl.constexpr, USE_DOT: tl.constexpr,
    X_AS_IS: tl.constexpr,
    X_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, EXPERTS: tl.constexpr, INTERPRET: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` output columns of ``BLOCK_M`` rows over one K split, in FMAs
    (one row, ``BLOCK_M == 1``) or tensor-core dots in the activations' dtype ``X_DTYPE``
    (``USE_DOT``, ``BLOCK_M >= 16``).

    ``EXPERTS`` (one row per program): row ``m`` multiplies the weight of expert
    ``ids[m]`` of stacked experts, whose words, scales (and zero points), global scale and bias
    lie ``stride_we``, ``stride_se``, ``stride_ge`` and ``N`` elements apart. FMAs read ``x`` in
    its own layout and dtype, rows ``stride_xm`` apart; dots read it regrouped
    (``permute_codes``, strides ``stride_xm`` and ``stride_xj``), or as it is (``X_AS_IS``)."""
    if EXPERTS:
        expert = tl.load(ids_ptr + tl.program_id(1)).to(tl.int64)
        words_ptr += expert * stride_we
        scale_ptr += expert * stride_se
        zero_ptr += expert * stride_se
        global_ptr += expert * stride_ge
        bias_ptr += expert * N
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    k_full = tl.maximum(k_begin, k_end - k_end % BLOCK_K)
    if USE_DOT:
        total = dot_k_range(
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), xp_ptr, words_ptr, scale_ptr,
            zero_ptr, global_ptr, offs_m, offs_n, k_begin, k_full, k_end, M, N, K, stride_xm,
            stride_xj, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE,
            BLOCK_N, BLOCK_K, MASK_N, USE_ASM, X_AS_IS, X_DTYPE, INTERPRET,
        )  # fmt: skip
    else:  # one row as the caller holds it (BLOCK_M == 1)
        total = quads_k_range(
            xp_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_begin, k_full,
            k_end, N, K, stride_xm, stride_w, stride_s, FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, MASK_N, USE_ASM, LOOP_STAGES,
        )[None, :]  # fmt: skip
    if SPLIT_SUM:  # the tile's last split sums the partials (counters at counter_ptr)
        sum_tile_splits(total, out_ptr, partial_ptr, counter_ptr, bias_ptr, offs_m, offs_n, M, N,
                        stride_om, stride_split, pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip
    else:
        store_tile(total, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
                   stride_split, pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip
