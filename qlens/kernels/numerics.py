"""Rounding helpers that stay exact under Triton's CPU interpreter."""

from typing import no_type_check

import triton
import triton.language as tl


@triton.jit
@no_type_check
def f32_to_bf16_rne(x):
    """Round float32 to bfloat16, nearest-even, with integer ops (the interpreter truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(x != x, 0x7FC00000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
@no_type_check
def cast_out(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even also in the interpreter."""
    if INTERPRET and dtype == tl.bfloat16:
        return f32_to_bf16_rne(x.to(tl.float32))
    return x.to(dtype)


@triton.jit
@no_type_check
def f32_to_e4m3_bits(v):
    """E4M3 bit pattern (uint8) of float32 values already clamped to +-448, nearest-even.

    Integer arithmetic only: the interpreter's own float8 conversion misrounds (see the tests).
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag_bits = bits & 0x7FFFFFFF
    rounded = mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)
    normal = ((((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)).to(tl.int32)
    scaled = mag_bits.to(tl.float32, bitcast=True) * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag_bits < 0x3C800000, subnormal, normal)
    return (tl.minimum(code, 0x7E) | sign.to(tl.int32)).to(tl.uint8)


@triton.jit
@no_type_check
def fp8_act_codes(x, AXIS: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-token dynamic FP8 of float32 ``x`` in groups along ``AXIS``: the e4m3 codes (uint8)
    of ``x / s`` and the groups' scales ``s = amax / 448`` (1 for an all-zero group)."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.math.div_rn(amax, 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.expand_dims(scale, AXIS)), -448.0), 448.0)
    if INTERPRET:
        codes = f32_to_e4m3_bits(v)
    else:
        codes = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return codes, scale


@triton.jit
@no_type_check
def fp8_rounded_row(x, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x[BLOCK_K]`` as W8A8 reads it: :func:`fp8_act_codes` per ``GROUP`` along K,
    decoded again (``code * scale``)."""
    codes, scale = fp8_act_codes(tl.reshape(x, (BLOCK_K // GROUP, GROUP)), 1, INTERPRET)
    decoded = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    return tl.reshape(decoded, (BLOCK_K,))
