"""quantize_weight -> dequantize stays within each element format's rounding bound."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from quant_weight_strategies import weights

from qlens.quant.codecs.element_scales import element_scales
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import SCHEMES, quantize_weight

# (scheme, options, element): the element decides the rounding bound.
CASES = [
    ("fp8-block", {}, "e4m3"),
    ("fp8-block", {"scale_dtype": "e8m0", "block_size": (16, 32)}, "e4m3"),
    ("mxfp8", {}, "e4m3"),
    ("mxfp4", {}, "e2m1"),
    ("nvfp4", {}, "e2m1"),
    ("int4", {"group_size": 32}, "int"),
    ("int4", {"group_size": 16, "asymmetric": True}, "int"),
    ("int4", {"scale_dtype": "bf16"}, "int"),
    ("int8", {}, "int"),
    ("int8", {"group_size": 32, "asymmetric": True, "scale_dtype": "fp16"}, "int"),
]
ELEMENT_MAX = {"e4m3": 448.0, "e2m1": 6.0}


def _half_spacing(x: torch.Tensor, element: str) -> torch.Tensor:
    """Half the distance between neighbouring representable magnitudes around ``x``."""
    if element == "e2m1":  # spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
        return torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    # e4m3: 3 mantissa bits; subnormal spacing 2**-9 below 2**-6
    exponent = torch.floor(torch.log2(x.clamp(min=2.0**-6)))
    return torch.ldexp(torch.ones_like(x), (exponent - 4).to(torch.int32))


def _error_bound(w: torch.Tensor, scale: torch.Tensor, element: str) -> torch.Tensor:
    if element == "int":
        bound = 0.5 * scale
    else:
        top = ELEMENT_MAX[element]
        x = torch.where(scale > 0, w.abs() / scale, torch.zeros_like(w))
        bound = scale * (_half_spacing(x.clamp(max=top), element) + (x - top).clamp(min=0))
    # fp32 rounding of the quotient and product, and subnormal products
    return bound * (1 + 2.0**-18) + w.abs() * 2.0**-22 + 2.0**-148


def _fit_scale_dtype(w: torch.Tensor, options: dict) -> torch.Tensor:
    """fp16 scales overflow beyond group ranges of ~1.6e7 (the refusal is tested separately)."""
    return w.clamp(-1e6, 1e6) if options.get("scale_dtype") == "fp16" else w


@pytest.mark.parametrize(("scheme", "options", "element"), CASES)
@given(w=weights())
def test_round_trip_error_within_the_element_bound(scheme, options, element, w):
    w = _fit_scale_dtype(w, options)
    payload = quantize_weight(w, scheme, **options)
    assert payload.shape == tuple(w.shape)
    restored = dequantize(payload)
    assert restored.shape == w.shape and restored.dtype == torch.float32
    error = (restored - w).abs()
    bound = _error_bound(w, element_scales(payload), element)
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (
        f"error {error.flatten()[worst]} > bound {bound.flatten()[worst]} at {worst} "
        f"(w={w.flatten()[worst]})"
    )
    assert bool((restored[w == 0] == 0).all())  # zeros (and zero groups) stay exactly zero


@given(w=weights(experts=False))
def test_mx_scale_exponent_is_floor_log2_amax_minus_emax(w):
    for scheme, emax in (("mxfp8", 8), ("mxfp4", 2)):
        payload = quantize_weight(w, scheme)
        k = w.shape[-1]
        for row in range(w.shape[0]):
            for g in range(-(-k // 32)):
                amax = w[row, g * 32 : (g + 1) * 32].abs().max().item()
                expected = 0 if amax == 0 else max(math.frexp(amax)[1] - 1 - emax + 127, 0)
                assert payload.scales[row, g].item() == expected


@given(w=weights(experts=False, min_exponent=-20, max_exponent=20))
def test_fp8_block_scales_are_amax_over_448(w):
    payload = quantize_weight(w, "fp8-block", block_size=(8, 16))
    n, k = w.shape
    for i in range(-(-n // 8)):
        for j in range(-(-k // 16)):
            amax = w[i * 8 : (i + 1) * 8, j * 16 : (j + 1) * 16].abs().max()
            expected = amax / 448 if amax > 0 else torch.tensor(1.0)
            assert payload.scales[i, j].item() == expected.item()
    e8m0 = quantize_weight(w, "fp8-block", block_size=(8, 16), scale_dtype="e8m0")
    powers = element_scales(e8m0)[::8, ::16]
    assert bool((powers >= payload.scales).all())
    # The smallest power of two at or above amax / 448, unless that is below E8M0's 2**-127
    # (subnormal blocks), where the scale stays at 2**-127.
    smallest = powers == 2.0**-127
    assert bool(((powers < 2 * payload.scales) | smallest).all())
    assert bool((payload.scales[smallest] <= 2.0**-127).all())


@pytest.mark.parametrize(("scheme", "options", "element"), CASES)
@given(w=weights(max_rows=8, max_cols=40))
def test_quantization_is_deterministic_and_per_expert(scheme, options, element, w):
    w = _fit_scale_dtype(w, options)
    first, second = quantize_weight(w, scheme, **options), quantize_weight(w, scheme, **options)
    for name, tensor in first.tensors().items():
        assert torch.equal(
            tensor.reshape(-1).view(torch.uint8),
            second.tensors()[name].reshape(-1).view(torch.uint8),
        )
    if w.dim() == 3 and scheme != "nvfp4":  # nvfp4 shares one global scale across experts
        stacked = torch.stack([dequantize(quantize_weight(e, scheme, **options)) for e in w])
        assert torch.equal(dequantize(first), stacked)


def _exact_codes(gen, shape, values):
    return values[torch.randint(0, len(values), shape, generator=gen)]


@given(st.integers(0, 2**31 - 1), st.integers(-30, 30), st.integers(1, 5), st.integers(1, 4))
def test_exactly_representable_weights_round_trip_exactly(seed, exponent, rows, groups):
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0**exponent
    k = 32 * groups
    # MXFP4: E2M1 values with a +-6 in every 32-block, scaled by 2**e
    fp4 = _exact_codes(gen, (rows, k), torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -1, -6]))
    fp4[:, ::32] = 6.0
    assert torch.equal(dequantize(quantize_weight(fp4 * scale, "mxfp4")), fp4 * scale)
    # NVFP4: a +-6 in every 16-block and one block scale of 448 make the global exactly 1
    nv = fp4.clone()
    nv[:, ::16] = -6.0
    block_scales = _exact_codes(gen, (rows, k // 16), torch.tensor([0.5, 1.0, 2.0, 448.0]))
    block_scales[0, 0] = 448.0
    nv_w = nv * block_scales.repeat_interleave(16, -1)
    assert torch.equal(dequantize(quantize_weight(nv_w, "nvfp4")), nv_w)
    # FP8: e4m3 values with a 448 in every block, block scale 2**e (fp32 and E8M0 scales)
    e4m3 = torch.randn(rows, k, generator=gen).mul(30).to(torch.float8_e4m3fn).float()
    e4m3[:, 0] = 448.0
    for options in ({"block_size": (rows, k)}, {"block_size": (rows, k), "scale_dtype": "e8m0"}):
        assert torch.equal(
            dequantize(quantize_weight(e4m3 * scale, "fp8-block", **options)), e4m3 * scale
        )
    # INT4 / INT8 symmetric: integer multiples of 2**e with the group max at 7 / 127
    int4 = torch.randint(-7, 8, (rows, k), generator=gen).float()
    int4[:, ::32] = 7.0
    assert torch.equal(
        dequantize(quantize_weight(int4 * scale, "int4", group_size=32)), int4 * scale
    )
    int8 = torch.randint(-127, 128, (rows, k), generator=gen).float()
    int8[:, ::32] = -127.0
    assert torch.equal(
        dequantize(quantize_weight(int8 * scale, "int8", group_size=32)), int8 * scale
    )


def test_schemes_are_documented_and_unknown_ones_rejected():
    assert set(SCHEMES) == {"fp8-block", "mxfp8", "mxfp4", "nvfp4", "int4", "int8"}
    with pytest.raises(ValueError, match=r"unknown scheme 'int3'; known schemes: \['fp8-block'"):
        quantize_weight(torch.zeros(2, 2), "int3")


def test_default_group_sizes_and_layouts():
    w = torch.randn(3, 300)
    int4 = quantize_weight(w, "int4")
    assert int4.format.block == (1, 128) and int4.scales.shape == (3, 3)
    assert int4.data.dtype == torch.uint8 and int4.data.shape == (3, 150) and int4.zeros is None
    int8 = quantize_weight(w, "int8", asymmetric=True)
    assert int8.data.dtype == torch.int8 and int8.zeros.dtype == torch.int8
    fp8 = quantize_weight(torch.randn(200, 300), "fp8-block")
    assert fp8.format.block == (128, 128) and fp8.scales.shape == (2, 3)
    mx = quantize_weight(w, "mxfp4")
    assert mx.data.shape == (3, 160) and mx.scales.shape == (3, 10)
    nv = quantize_weight(w, "nvfp4")
    assert nv.data.shape == (3, 152) and nv.scales.dtype == torch.float8_e4m3fn
    assert nv.global_scale.shape == () and nv.format.global_scale == "multiply"
    assert all(p.layout["packing"] == "qlens" for p in (int4, int8, fp8, mx, nv))


def test_half_precision_scales_that_would_overflow_are_refused():
    with pytest.raises(ValueError, match=r"overflow fp16 scales; use scale_dtype='fp32'"):
        quantize_weight(torch.full((1, 4), 1e9), "int8", scale_dtype="fp16")


@pytest.mark.parametrize("scheme", ["fp8-block", "mxfp8", "mxfp4", "nvfp4", "int4", "int8"])
def test_transposed_weight_gives_contiguous_payload(scheme: str) -> None:
    weight = torch.randn(64, 128).t()  # a transposed view, as GPT-2's Conv1D holds
    payload = quantize_weight(weight, scheme)
    for name, tensor in payload.tensors().items():
        assert tensor.is_contiguous(), f"{scheme}: {name} is not contiguous"
    torch.testing.assert_close(
        dequantize(payload),
        dequantize(quantize_weight(weight.contiguous(), scheme)),
        rtol=0,
        atol=0,
    )
