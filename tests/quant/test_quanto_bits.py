"""optimum-quanto qint4 / qint2 weights (float or integer shift, TinyGemm) against quanto's own
``dequantize()``, and the quanto packing codec against its formula evaluated here in float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qlens
from qlens.kernels.weights import unsupported_reason
from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.element_scales import element_scales
from qlens.quant.codecs.intgroup import repack_to_qlens, unpack_int, validate_int_group
from qlens.quant.codecs.quanto_bits import (
    pack_quanto_codes,
    quanto_bits_payload,
    unpack_quanto_codes,
    validate_quanto_bits,
)
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload

quanto = pytest.importorskip("optimum.quanto")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (in, out) -> quanto's group size: None (per row, in <= 128), 32, 64, 96, 128, 128 (+ TinyGemm).
SHAPES = [(64, 8), (160, 7), (320, 16), (288, 5), (256, 48), (512, 16)]


def _frozen(qtype, dtype, k, n, seed=0):
    """A frozen quanto ``QLinear`` whose rows span several binades."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n))
    with torch.no_grad():
        model[0].weight.mul_(torch.randn(n, 1).mul(3).exp())
    model = model.to(dtype)
    quanto.quantize(model, weights=qtype)
    quanto.freeze(model)
    return model[0]


def _holding(qweight):
    """A linear module holding a hand-quantized quanto weight."""
    module = nn.Linear(qweight.shape[1], qweight.shape[0], bias=False)
    module.weight = nn.Parameter(qweight, requires_grad=False)
    return module


def _quantized(dtype, group, *, zeropoint=False, axis=0, optimized=True, bits=4, shape=(16, 256)):
    torch.manual_seed(1)
    w = torch.randn(shape).to(dtype)
    qtype = quanto.qint4 if bits == 4 else quanto.qint2
    scale, shift = quanto.MaxOptimizer()(
        w, qtype=qtype, axis=axis, group_size=group, zeropoint=zeropoint
    )
    return quanto.WeightQBitsTensor.quantize(w, qtype, axis, group, scale, shift, optimized)


def _assert_exact(module):
    expected = module.weight.dequantize()
    payload = adopt_module(module)
    assert torch.equal(qlens.dequantize(module, torch.float32), expected.float())
    assert torch.equal(qlens.dequantize(payload, torch.float32), expected.float())
    assert torch.equal(qlens.dequantize(payload, expected.dtype), expected)
    scales = element_scales(payload)  # one code step per element: the group's scale
    group = payload.format.block[1]
    assert torch.equal(scales[:, ::group], payload.scales.float())
    assert torch.equal(scales, payload.scales.float().repeat_interleave(group, dim=1))
    return payload


# --- against quanto -----------------------------------------------------------------------


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype_name", ["qint4", "qint2"])
def test_frozen_qlinear_matches_quanto_dequantize(qtype_name, dtype, k, n):
    qtype = getattr(quanto, qtype_name)
    module = _frozen(qtype, dtype, k, n, seed=k + n)
    assert is_quantized_module(module)
    payload = _assert_exact(module)
    assert payload.format.name == f"int{qtype.bits}"
    assert payload.format.zero_point == "float"
    assert payload.layout["packing"] == "quanto"
    assert payload.format.block == (1, module.weight._group_size or k)
    assert "float shift" in payload.format.description


@pytest.mark.parametrize("k,n", [(256, 48), (384, 32)])
def test_tinygemm_matches_quanto_dequantize(k, n):
    module = _frozen(quanto.qint4, torch.bfloat16, k, n, seed=3)
    assert type(module.weight).__name__ == "TinyGemmWeightQBitsTensor"
    payload = _assert_exact(module)
    assert payload.layout["source"] == "optimum-quanto tinygemm"
    assert payload.scales.dtype == torch.bfloat16 and payload.format.block == (1, 128)


@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
def test_integer_shift_matches_quanto_dequantize(bits, dtype, group):
    # optimized=False: quanto's own TinyGemm constructor rejects an integer shift (bf16, g=128).
    qweight = _quantized(dtype, group, zeropoint=True, bits=bits, optimized=False)
    assert not qweight._shift.dtype.is_floating_point
    payload = _assert_exact(_holding(qweight))
    assert payload.format.zero_point == "int" and payload.zeros.dtype == torch.uint8


@pytest.mark.parametrize("group", [32, 64, 128])
def test_unoptimized_and_hqq_weights(group):
    module = _holding(_quantized(torch.bfloat16, group, optimized=False))
    assert type(module.weight).__name__ == "WeightQBitsTensor"
    _assert_exact(module)
    torch.manual_seed(2)
    w = torch.randn(16, 256, dtype=torch.float16)
    scale, shift = quanto.HqqOptimizer()(w, qtype=quanto.qint4, axis=0, group_size=group)
    qweight = quanto.WeightQBitsTensor.quantize(w, quanto.qint4, 0, group, scale, shift)
    _assert_exact(_holding(qweight))


def test_adopted_payload_shares_quanto_packed_bytes():
    module = _frozen(quanto.qint2, torch.float16, 320, 16)
    payload = adopt_module(module)
    assert payload.data.data_ptr() == module.weight._data._data.data_ptr()


# --- codec property --------------------------------------------------------------------------


def _reference(codes, scales, shift, group, dtype):
    """quanto's arithmetic as IEEE ops correctly rounded to ``dtype``, evaluated in float64."""
    s = scales.double().repeat_interleave(group, dim=1)
    z = shift.double().repeat_interleave(group, dim=1)
    if not shift.dtype.is_floating_point:
        return (s * (codes.double() - z)).to(dtype)
    product = (s * codes.double()).to(dtype)
    return (product.double() - z).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 9),
    groups=st.integers(1, 3),
    group=st.sampled_from([1, 3, 8, 32]),
    float_shift=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_codec_matches_formula(bits, dtype, n, groups, group, float_shift, seed):
    gen = torch.Generator().manual_seed(seed)
    k = groups * group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    exponents = torch.randint(-8, 5, (n, groups), generator=gen).float()
    scales = (torch.rand((n, groups), generator=gen) + 0.5).mul(exponents.exp2()).to(dtype)
    if float_shift:
        shift = (scales.float() * torch.rand((n, groups), generator=gen) * (1 << bits)).to(dtype)
    else:
        shift = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8)
    payload = quanto_bits_payload(codes, scales, shift, bits=bits, group_size=group)
    expected = _reference(codes, scales, shift, group, dtype)
    assert torch.equal(qlens.dequantize(payload, dtype), expected)
    assert torch.equal(qlens.dequantize(payload, torch.float32), expected.float())
    rows = n * groups
    assert torch.equal(unpack_quanto_codes(payload.data, bits, rows), codes.reshape(rows, group))


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_matches_quanto_packed_tensor(bits):
    codes = torch.randint(0, 1 << bits, (13, 6), generator=torch.Generator().manual_seed(bits))
    theirs = quanto.tensor.packed.PackedTensor.pack(codes.to(torch.uint8), bits)
    assert torch.equal(pack_quanto_codes(codes, bits), theirs._data)


# --- refusals --------------------------------------------------------------------------------


def _payload(bits=4, dtype=torch.bfloat16, float_shift=True, n=5, k=64, group=32):
    codes = torch.randint(0, 1 << bits, (n, k), generator=torch.Generator().manual_seed(0))
    scales = torch.rand(n, k // group).add(0.5).to(dtype)
    shift = scales.clone() if float_shift else torch.full((n, k // group), 1, dtype=torch.uint8)
    return quanto_bits_payload(codes, scales, shift, bits=bits, group_size=group)


def _edited(**changes):
    payload = _payload()
    for name, value in changes.items():
        setattr(payload, name, value)
    return payload


@pytest.mark.parametrize(
    "payload,match",
    [
        (lambda p: _edited(data=p.data.to(torch.int8)), r"`data` must be torch.uint8"),
        (lambda p: _edited(data=p.data[:-1]), r"`data` must have shape \[5, 32\]"),
        (lambda p: _edited(data=p.data.t().contiguous().t()), "must be contiguous"),
        (lambda p: _edited(scales=p.scales[:, :1]), r"`scales` must have shape \[5, 2\]"),
        (lambda p: _edited(scales=p.scales.half()), "format says scale_dtype='bf16'"),
        (lambda p: _edited(zeros=None), r"`zeros \(shift\)` is missing"),
        (lambda p: _edited(zeros=p.zeros.float()), r"shift\)` must be torch.bfloat16"),
        (lambda p: _edited(zeros=p.zeros[:2]), r"shift\)` must have shape \[5, 2\]"),
        (lambda p: _edited(zeros=p.zeros / 0), "must be finite"),
        (lambda p: _edited(zeros=p.zeros.to("meta")), "is on meta but `data` is on cpu"),
        (lambda p: _edited(shape=(1, 5, 64)), r"must be one \[out, in\] weight"),
        (
            lambda p: _edited(
                format=int_group_format(4, 48, zero_point="float", scale_dtype="bf16")
            ),
            "g dividing",
        ),
        (lambda p: _edited(format=int_group_format(4, 32, scale_dtype="bf16")), "always stores"),
        (lambda p: _edited(format=int_group_format(8, 32, zero_point="float")), "int2 or int4"),
    ],
)
def test_bad_payloads_are_refused(payload, match):
    with pytest.raises(ValueError, match=match):
        qlens.dequantize(payload(_payload()))


def test_bad_codes_and_shifts_are_refused():
    codes = torch.zeros(4, 64, dtype=torch.long)
    scales = torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"`codes` must hold unsigned 4-bit codes"):
        quanto_bits_payload(codes + 16, scales, scales, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"`shift` must hold unsigned 2-bit codes"):
        quanto_bits_payload(codes, scales, torch.full((4, 2), 4), bits=2, group_size=32)
    with pytest.raises(ValueError, match="group_size 48 does not divide 64"):
        quanto_bits_payload(codes, scales, scales, bits=4, group_size=48)
    with pytest.raises(ValueError, match="quanto packs"):
        pack_quanto_codes(codes, 3)


def test_float_shift_has_no_integer_zero_point():
    payload = _payload()
    with pytest.raises(ValueError, match="float shift"):
        repack_to_qlens(payload)
    with pytest.raises(ValueError, match="float shift"):
        unpack_int(payload)
    as_qlens = QuantPayload(**{**payload.__dict__, "layout": {"packing": "qlens"}})
    with pytest.raises(ValueError, match="float shift"):
        validate_int_group(as_qlens)
    as_gptq = QuantPayload(**{**payload.__dict__, "layout": {"packing": "gptq"}})
    with pytest.raises(ValueError, match="integer zero points"):
        unpack_int(as_gptq)
    assert "packing is 'quanto'" in (unsupported_reason(payload) or "")


def test_integer_shift_int4_repacks_to_qlens():
    payload = _payload(float_shift=False)
    repacked = repack_to_qlens(payload)
    assert repacked.layout["packing"] == "qlens"
    assert torch.equal(
        qlens.dequantize(repacked, torch.bfloat16), qlens.dequantize(payload, torch.bfloat16)
    )
    with pytest.raises(ValueError, match="only 4- and 8-bit"):
        repack_to_qlens(_payload(bits=2, float_shift=False))
    validate_quanto_bits(payload)


def test_cuda_only_layouts_and_other_axes_are_refused():
    module = nn.Module()
    module.weight = type("AWQWeightQBitsTensor", (), {"qtype": quanto.qint4})()
    assert is_quantized_module(module)
    with pytest.raises(NotImplementedError, match="CUDA AWQWeightQBitsTensor layout"):
        adopt_module(module)
    qweight = _quantized(torch.float32, 8, axis=-1)
    with pytest.raises(NotImplementedError, match="along axis -1"):
        adopt_module(_holding(qweight))
