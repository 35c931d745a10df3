"""Element codecs against torch's own dtypes, torchao's bit-level converters and the specs."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.quant.codecs.elements import (
    E2M1_VALUES,
    as_e8m0_bytes,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
)

torchao_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")


def _e2m1_from_bits(code: int) -> float:
    """E2M1 per the OCP spec: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def _e4m3fn_from_bits(byte: int) -> float:
    """E4M3FN per the OCP spec: bias 7, no infinities, S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    if exponent == 0xF and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * 2.0**-6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


def test_e2m1_table_matches_the_bit_layout():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor([_e2m1_from_bits(c) for c in range(16)])
    assert torch.equal(decode_e2m1(codes), expected)
    assert torch.equal(torch.tensor(E2M1_VALUES).signbit(), codes >= 8)


def test_e2m1_decode_matches_torchao():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(decode_e2m1(codes), torchao_kernels.f4_unpacked_to_f32(codes))


@given(
    st.lists(
        st.floats(min_value=-8, max_value=8, allow_nan=False, width=32), min_size=1, max_size=64
    )
)
def test_e2m1_encode_matches_torchao_rounding(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(encode_e2m1(x), torchao_kernels.f32_to_f4_unpacked(x))


def test_e2m1_encode_ties_go_to_even_codes_and_saturate():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.75])
    assert encode_e2m1(midpoints).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 10]
    assert torch.equal(
        encode_e2m1(torchao_kernels.f4_unpacked_to_f32(torch.arange(16, dtype=torch.uint8))),
        torch.arange(16, dtype=torch.uint8),
    )


def test_e8m0_decode_matches_torch_dtype_for_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = decode_e8m0(b)
    theirs = b.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], theirs[:255])
    assert ours[0].item() == 2.0**-127 and ours[127].item() == 1.0
    assert math.isnan(ours[255].item()) and math.isnan(theirs[255].item())


def test_e8m0_bytes_accept_both_containers():
    b = torch.tensor([0, 126, 254], dtype=torch.uint8)
    assert as_e8m0_bytes(b.view(torch.float8_e8m0fnu)).dtype == torch.uint8
    assert torch.equal(as_e8m0_bytes(b.view(torch.float8_e8m0fnu)), b)


def test_e8m0_encode_clamps_to_the_representable_exponents():
    exponents = torch.tensor([-200, -127, 0, 5, 127, 300])
    assert encode_e8m0(exponents).tolist() == [0, 0, 127, 132, 254, 254]


def test_e4m3_decode_matches_spec_for_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = torch.tensor([_e4m3fn_from_bits(i) for i in range(256)])
    ours = decode_e4m3(b)
    assert torch.equal(ours.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(ours[finite], expected[finite])
    torch.testing.assert_close(
        decode_e4m3(b.view(torch.float8_e4m3fn)), ours, rtol=0, atol=0, equal_nan=True
    )


def test_e4m3_encode_saturates_instead_of_nan():
    x = torch.tensor([1000.0, -1e30, 448.0, 464.0, 0.0019531])
    assert decode_e4m3(encode_e4m3(x)).tolist()[:4] == [448.0, -448.0, 448.0, 448.0]
