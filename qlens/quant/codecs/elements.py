"""Element decoders and encoders shared by the codecs: E2M1 (FP4), E4M3 (FP8) and E8M0 scales."""

from __future__ import annotations

import torch
from jaxtyping import Float, Integer, UInt8
from torch import Tensor

# Value of each 4-bit E2M1 code; bit 3 is the sign.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
# Largest unbiased exponent of each element type (OCP MX: scale exponent = floor(log2 amax) - emax).
ELEMENT_EMAX = {"e4m3": 8, "e2m1": 2}

# Midpoints between consecutive E2M1 magnitudes, and whether a tie there rounds up (to the even
# code) rather than down.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def e2m1_table(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> Float[Tensor, "16"]:
    """The 16 E2M1 code values as a lookup table."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def decode_e2m1(codes: UInt8[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """float32 value of each 4-bit E2M1 code (0..15)."""
    return e2m1_table(codes.device)[codes.long()]


def encode_e2m1(values: Float[Tensor, "*shape"]) -> UInt8[Tensor, "*shape"]:
    """Nearest E2M1 code of each value, ties to even, saturating at +-6; the sign is kept on zero."""
    magnitude = values.abs().float()
    codes = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for midpoint, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP, strict=True):
        above = magnitude >= midpoint if tie_up else magnitude > midpoint
        codes += above.to(torch.uint8)
    return codes | (torch.signbit(values).to(torch.uint8) << 3)


def decode_e8m0(scale_bytes: UInt8[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """float32 ``2**(b - 127)`` of each E8M0 byte: 0 is 2**-127 (not zero), 255 is NaN.

    The bytes are reinterpreted, never numerically cast: the fp32 exponent field is the byte itself
    (byte 0 is the fp32 subnormal 2**-127).
    """
    b = scale_bytes.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    decoded = bits.view(torch.float32)
    return torch.where(b == E8M0_NAN, torch.full_like(decoded, float("nan")), decoded)


def encode_e8m0(exponent: Integer[Tensor, "*shape"]) -> UInt8[Tensor, "*shape"]:
    """E8M0 byte of each unbiased power-of-two exponent (clamped to the range -127..127)."""
    return (exponent.to(torch.int32).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def as_e8m0_bytes(scales: Tensor) -> Tensor:
    """E8M0 scales as uint8 bytes, whether held as ``uint8`` or as ``torch.float8_e8m0fnu``.

    Other dtypes are returned unchanged, for the caller's validation to report.
    """
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8)
    return scales


def decode_e4m3(codes: Tensor) -> Float[Tensor, "*shape"]:
    """float32 value of each E4M3 element, given as ``float8_e4m3fn`` or as its uint8 bit pattern."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.float()


def encode_e4m3(values: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """Round to ``float8_e4m3fn`` (nearest, ties to even), saturating at +-448 instead of NaN."""
    return values.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
