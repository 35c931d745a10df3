"""Triton device functions decoding tiles of a quantized weight to float32.

Every family is decoded with the same operation order as its torch codec, so the dequantize
kernels are bit-exact and the linear kernels see exactly the codec's weights. Packed 4-bit
weights are decoded as two half tiles (even and odd K) so that no interleaving shuffle is needed:
the linear kernels multiply them with the even and odd activation columns.
"""

from typing import no_type_check

import triton
import triton.language as tl

from qlens.kernels.layout_view import BNB4, INT4, INT8, NVFP4

BNB4_C = tl.constexpr(BNB4)
NVFP4_C = tl.constexpr(NVFP4)
INT4_C = tl.constexpr(INT4)
INT8_C = tl.constexpr(INT8)

# Each @triton.jit function also carries @no_type_check: Triton compiles the function's own
# source and globals, so no runtime type-check wrapper may sit between the two.


@triton.jit
@no_type_check
def e8m0_to_f32(b):
    """float32 ``2**(b - 127)`` of E8M0 bytes by bit reinterpretation (0 -> 2**-127, 255 -> NaN)."""
    b = b.to(tl.int32)
    bits = tl.where(b == 0, 1 << 22, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
@no_type_check
def e4m3_to_f32(b):
    """float32 value of E4M3 bytes by bit placement: the seven magnitude bits at fp16 bits 13..7
    and the sign at bit 15 make the fp16 ``value * 2**-8`` (subnormals included), and both
    conversions back are exact; 0x7F and 0xFF are NaN. Elementwise on any layout, unlike the
    hardware's paired fp8 conversion."""
    b = b.to(tl.int32)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    value = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
@no_type_check
def e2m1_to_f32(code):
    """float32 value of 4-bit E2M1 codes (bit 3 is the sign): the magnitude bits placed at fp16
    bits 11..9 and the sign at bit 15 make the fp16 ``value * 2**-14`` (subnormal 0.5 included),
    and both conversions back are exact."""
    code = code.to(tl.int32)
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
@no_type_check
def _group_values(ptr, offs_n, groups, N, n_groups, stride, GROUP_N: tl.constexpr, other):
    """Per-group values (scales or zeros) at rows ``offs_n`` and group indices ``groups``.

    ``groups`` is a ``[1, C]`` row of group indices; returns ``[BN, C]``.
    """
    rows = (offs_n // GROUP_N)[:, None]
    mask = (offs_n < N)[:, None] & (groups < n_groups)
    return tl.load(ptr + rows * stride + groups, mask=mask, other=other)


@triton.jit
@no_type_check
def _scales(scale_ptr, global_ptr, offs_n, groups, N, n_groups, stride, FAMILY: tl.constexpr,
            GROUP_N: tl.constexpr, SCALE_E8M0: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr):  # fmt: skip
    """float32 multipliers ``[BN, C]`` of the groups ``groups`` (``[1, C]``) of rows ``offs_n``."""
    rows = (offs_n // GROUP_N)[:, None]
    mask = (offs_n < N)[:, None] & (groups < n_groups)
    return scale_values(scale_ptr, global_ptr, rows * stride + groups, mask, FAMILY, SCALE_E8M0,
                        GLOBAL_DIVIDE)  # fmt: skip


@triton.jit
@no_type_check
def scale_values(scale_ptr, global_ptr, offsets, mask, FAMILY: tl.constexpr,
                 SCALE_E8M0: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr):  # fmt: skip
    """float32 multipliers of the scales at ``offsets`` (any shape), the NVFP4 global folded in
    as the codec does; masked lanes read a finite scale.

    uint8 scales are E8M0 (``SCALE_E8M0``) or E4M3 bit patterns (NVFP4 in the tensor-core
    GEMV, decoded by bit operations); float8 and wider ones convert directly."""
    if SCALE_E8M0:
        s = e8m0_to_f32(tl.load(scale_ptr + offsets, mask=mask, other=127))
    elif scale_ptr.dtype.element_ty == tl.uint8:
        # 0x38 is E4M3 1.0: masked groups stay finite.
        s = e4m3_to_f32(tl.load(scale_ptr + offsets, mask=mask, other=0x38))
    else:
        s = tl.load(scale_ptr + offsets, mask=mask, other=1.0).to(tl.float32)
    if FAMILY == NVFP4_C:
        g = tl.load(global_ptr)
        if GLOBAL_DIVIDE:
            s = tl.math.div_rn(s, g)
        else:
            s = g * s
    return s


@triton.jit
@no_type_check
def _tile_groups(k0, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Indices ``[1, max(BLOCK_K / GROUP_K, 1)]`` of the scale groups a K tile spans."""
    SPAN: tl.constexpr = BLOCK_K // GROUP_K if BLOCK_K > GROUP_K else 1
    return (k0 // GROUP_K + tl.arange(0, SPAN))[None, :]


@triton.jit
@no_type_check
def _expand(values, BLOCK_N: tl.constexpr, COLS: tl.constexpr, RUN: tl.constexpr,
            SEVERAL: tl.constexpr):  # fmt: skip
    """Repeat per-group ``[BN, COLS / RUN]`` values ``RUN`` times along K (``[BN, 1]`` stays)."""
    if SEVERAL:
        wide = tl.broadcast_to(values[:, :, None], (BLOCK_N, COLS // RUN, RUN))
        return tl.reshape(wide, (BLOCK_N, COLS))
    else:
        return values


@triton.jit
@no_type_check
def decode_packed_halves(
    data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
    FAMILY: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """float32 ``(W[n, k0 + 2j], W[n, k0 + 2j + 1])`` for ``j < BLOCK_K / 2`` of a 4-bit weight.

    Zero outside the matrix. Both elements of a byte share one group (groups are even). ``BNB4``
    bytes hold the even element in the high nibble, and codes index the table at ``global_ptr``.
    """
    HALF: tl.constexpr = BLOCK_K // 2
    n_groups = tl.cdiv(K, GROUP_K)
    offs_b = k0 // 2 + tl.arange(0, HALF)
    if EVEN_K:  # no mask along K, so the byte loads vectorize
        mask = (offs_n < N)[:, None]
    else:
        mask = (offs_n < N)[:, None] & (offs_b < tl.cdiv(K, 2))[None, :]
    packed = tl.load(data_ptr + offs_n[:, None] * stride_d + offs_b[None, :], mask=mask, other=0)
    lo = packed & 0xF
    hi = packed >> 4
    groups = _tile_groups(k0, GROUP_K, BLOCK_K)
    s = _expand(
        _scales(scale_ptr, global_ptr, offs_n, groups, N, n_groups, stride_s, FAMILY, GROUP_N,
                SCALE_E8M0, GLOBAL_DIVIDE),
        BLOCK_N, HALF, GROUP_K // 2, BLOCK_K > GROUP_K,
    )  # fmt: skip
    if FAMILY == INT4_C:
        if HAS_ZEROS:
            z = _group_values(zero_ptr, offs_n, groups, N, n_groups, stride_s, GROUP_N, 0)
            z = _expand(z.to(tl.int32), BLOCK_N, HALF, GROUP_K // 2, BLOCK_K > GROUP_K)
        else:
            z = 8
        even = (lo.to(tl.int32) - z).to(tl.float32)
        odd = (hi.to(tl.int32) - z).to(tl.float32)
    elif FAMILY == BNB4_C:
        even = tl.load(global_ptr + hi.to(tl.int32))
        odd = tl.load(global_ptr + lo.to(tl.int32))
    else:
        even = e2m1_to_f32(lo)
        odd = e2m1_to_f32(hi)
    return even * s, odd * s


@triton.jit
@no_type_check
def decode_byte_tile(
    data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
    FAMILY: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """float32 ``W[n, k0:k0 + BLOCK_K]`` of a one-byte-per-element weight (e4m3 or int8)."""
    w, s = byte_tile_codes(
        data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, offs_n, k0, N, K, stride_d, stride_s,
        FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
    )  # fmt: skip
    return w * s


@triton.jit
@no_type_check
def byte_tile_codes(
    data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, scale_rows, k0, N, K, stride_d, stride_s,
    FAMILY: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """The float32 codes ``[BLOCK_N, BLOCK_K]`` of a one-byte-per-element weight (e4m3, or int8
    less its zero points) at rows ``offs_n``, and the multipliers ``[R, BLOCK_K]`` of rows
    ``scale_rows`` (``R`` rows: ``offs_n``, or its first row when all rows share their scales)."""
    n_groups = tl.cdiv(K, GROUP_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        mask = (offs_n < N)[:, None]
    else:
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    q = tl.load(data_ptr + offs_n[:, None] * stride_d + offs_k[None, :], mask=mask, other=0)
    groups = _tile_groups(k0, GROUP_K, BLOCK_K)
    s = _expand(
        _scales(scale_ptr, global_ptr, scale_rows, groups, N, n_groups, stride_s, FAMILY, GROUP_N,
                SCALE_E8M0, GLOBAL_DIVIDE),
        scale_rows.shape[0], BLOCK_K, GROUP_K, BLOCK_K > GROUP_K,
    )  # fmt: skip
    if FAMILY == INT8_C:
        if HAS_ZEROS:
            z = _group_values(zero_ptr, offs_n, groups, N, n_groups, stride_s, GROUP_N, 0)
            z = _expand(z.to(tl.int32), BLOCK_N, BLOCK_K, GROUP_K, BLOCK_K > GROUP_K)
            w = (q.to(tl.int32) - z).to(tl.float32)
        else:
            w = q.to(tl.float32)
    else:  # e4m3 bytes, passed as uint8 so that masked lanes load +0.0
        w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return w, s
