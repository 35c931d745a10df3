"""Pack/unpack identities on each format's packed domain, expert dims and swizzled layouts."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.quant.codecs.bits import pack_nibbles, unpack_nibbles
from qlens.quant.codecs.element_scales import element_scales
from qlens.quant.codecs.elements import encode_e2m1, encode_e4m3
from qlens.quant.codecs.fp8 import pack_fp8_block
from qlens.quant.codecs.intgroup import pack_int_group, unpack_int
from qlens.quant.codecs.intpackings import pack_compressed_tensors, pack_gptq
from qlens.quant.codecs.mx import pack_mx
from qlens.quant.codecs.nvfp4 import pack_nvfp4
from qlens.quant.codecs.swizzle import swizzle_32_4_4
from qlens.quant.dequantize import dequantize
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

shapes = st.tuples(st.integers(1, 3), st.integers(1, 20), st.integers(1, 70))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _e4m3_bytes(gen, shape):
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    return torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)  # no NaN patterns


@given(shape=shapes, seed=st.integers(0, 2**31 - 1), e8m0=st.booleans())
def test_fp8_block_packed_domain_round_trips(shape, seed, e8m0):
    gen = _gen(seed)
    e, n, k = shape
    data = _e4m3_bytes(gen, (e, n, k)).view(torch.float8_e4m3fn)
    grid = (e, -(-n // 8), -(-k // 16))
    if e8m0:
        scales = torch.randint(100, 160, grid, generator=gen, dtype=torch.int32).to(torch.uint8)
    else:
        scales = torch.ldexp(torch.ones(grid), torch.randint(-20, 20, grid, generator=gen))
    payload = pack_fp8_block(data, scales, block=(8, 16))
    w = dequantize(payload)
    again = encode_e4m3(w / element_scales(payload))
    assert torch.equal(again.view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), swizzle=st.booleans())
def test_fp4_packed_domain_round_trips(scheme, shape, seed, swizzle):
    gen = _gen(seed)
    e, n, k = shape
    group = 32 if scheme == "mxfp4" else 16
    groups = -(-k // group)
    codes = torch.randint(0, 16, (e, n, groups * group), generator=gen, dtype=torch.int32)
    codes[..., k:] = 0  # padding codes beyond K are zero
    data = pack_nibbles(codes.to(torch.uint8))
    layout = {"scale_swizzle": "32_4_4" if swizzle else "none"}
    if scheme == "mxfp4":
        scales = torch.randint(110, 150, (e, n, groups), generator=gen, dtype=torch.int32).to(
            torch.uint8
        )
        stored = swizzle_32_4_4(scales) if swizzle else scales
        payload = pack_mx(data, stored, (e, n, k), layout=layout)
    else:
        scales = torch.rand(e, n, groups, generator=gen).mul(400).add(0.02).to(torch.float8_e4m3fn)
        stored = swizzle_32_4_4(scales) if swizzle else scales
        payload = pack_nvfp4(data, stored, torch.tensor(3e-4), (e, n, k), layout=layout)
    w = dequantize(payload)
    assert w.shape == (e, n, k)
    again = encode_e2m1(w / element_scales(payload))
    assert torch.equal(again, unpack_nibbles(data, k))
    repacked = pack_nibbles(torch.nn.functional.pad(again, (0, groups * group - k)))
    assert torch.equal(repacked, data)


@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_mxfp8_swizzled_scales_dequantize_like_linear_ones(shape, seed):
    w = torch.randn(shape, generator=_gen(seed))
    linear = quantize_weight(w, "mxfp8")
    swizzled = pack_mx(
        linear.data, swizzle_32_4_4(linear.scales), linear.shape, layout={"scale_swizzle": "32_4_4"}
    )
    assert torch.equal(dequantize(swizzled), dequantize(linear))


@pytest.mark.parametrize("bits", [4, 8])
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), asym=st.booleans())
def test_integer_codes_round_trip_through_every_packing(bits, shape, seed, asym):
    gen = _gen(seed)
    e, n, k = shape
    group = 16
    g = -(-k // group)
    codes = torch.randint(0, 1 << bits, (e, n, k), generator=gen)
    zeros = torch.randint(1, 1 << bits, (e, n, g), generator=gen) if asym else None
    scales = torch.rand(e, n, g, generator=gen) + 0.5
    qlens = pack_int_group(codes, scales, zeros, bits=bits, group_size=group)
    fmt = int_group_format(bits, group, zero_point="int" if asym else "none")
    qweight, qzeros, gscales = pack_gptq(
        codes, scales, zeros, bits=bits, group_size=group, checkpoint_format="gptq_v2"
    )
    gptq = QuantPayload(
        fmt,
        qweight,
        (e, n, k),
        gscales,
        qzeros,
        layout={"packing": "gptq", "checkpoint_format": "gptq_v2"},
    )
    packed, zero_points = pack_compressed_tensors(codes, zeros, bits=bits)
    ct = QuantPayload(
        fmt, packed, (e, n, k), scales, zero_points, layout={"packing": "compressed-tensors"}
    )
    for payload in (qlens, gptq, ct):
        unpacked = unpack_int(payload)
        assert torch.equal(unpacked.codes, codes), payload.layout
        expected_zeros = zeros if asym else torch.full((e, n, g), 1 << (bits - 1))
        assert torch.equal(unpacked.zeros, expected_zeros)
        assert torch.equal(dequantize(payload), dequantize(qlens))


@pytest.mark.parametrize("convention", ["multiply", "divide"])
def test_nvfp4_per_expert_global_scales(convention):
    w = torch.randn(3, 5, 40, generator=_gen(7))
    one = quantize_weight(w, "nvfp4")
    globals_ = torch.tensor([0.5, 2.0, 8.0])
    per_expert = pack_nvfp4(one.data, one.scales, globals_, one.shape, global_convention=convention)
    for e in range(3):
        single = pack_nvfp4(
            one.data[e], one.scales[e], globals_[e], one.shape[1:], global_convention=convention
        )
        assert torch.equal(dequantize(per_expert)[e], dequantize(single))
    base = pack_nvfp4(one.data, one.scales, torch.tensor(1.0), one.shape)
    factor = globals_ if convention == "multiply" else 1 / globals_
    assert torch.equal(dequantize(per_expert), dequantize(base) * factor[:, None, None])
