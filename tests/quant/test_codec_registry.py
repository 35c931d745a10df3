"""One Codec per format name: what ``qlens.dequantize``, ``quantize_weight`` and ``qlens.quantize``
read, so that registering a format is the only step that makes it known to them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import qlens
from qlens.modules import model_quantize
from qlens.quant import quantize as quantize_module
from qlens.quant.adopt.higgs_gguf import gguf_payload
from qlens.quant.codecs import registry
from qlens.quant.codecs.codec import Codec, QuantizeOptions
from qlens.quant.codecs.element_scales import element_scales
from qlens.quant.codecs.gguf import Q8_0
from qlens.quant.codecs.intgroup import dequantize_int_group, quantize_int_group, validate_int_group
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

NATIVE = {
    "fp8_block": "fp8-block",
    "mxfp8": "mxfp8",
    "mxfp4": "mxfp4",
    "nvfp4": "nvfp4",
    "int4": "int4",
    "int8": "int8",
}
TOY = "toy_int8"


def test_every_format_has_exactly_one_codec_reachable_by_its_name():
    every = registry.codecs()
    names = [c.name for c in every]
    assert len(names) == len(set(names)) and len({id(c) for c in every}) == len(every)
    assert registry.known_formats() == sorted(names)
    for codec in every:
        assert registry.codec_for(codec.name) is codec
        assert registry.dequantizer_for(codec.name) is codec.dequantize


def test_the_quantize_schemes_are_the_native_codecs_in_registration_order():
    quantizing = {c.scheme: c.name for c in registry.codecs() if c.quantize is not None}
    assert quantizing == {scheme: name for name, scheme in NATIVE.items()}
    assert list(quantize_module.SCHEMES) == list(NATIVE.values())
    assert model_quantize.SCHEMES == tuple(NATIVE.values())
    descriptions = quantize_module.SCHEMES
    assert descriptions["fp8-block"].startswith("FP8 e4m3, one fp32 scale (amax/448) per 128x128")
    assert all(
        descriptions[s] == registry.codec_for(n).scheme_description for n, s in NATIVE.items()
    )


def test_the_scheme_order_does_not_depend_on_which_codec_was_imported_first():
    script = (
        "import qlens.quant.codecs.gguf, qlens.quant.codecs.intgroup\n"
        "from qlens.quant.quantize import SCHEMES\n"
        "print(' '.join(SCHEMES))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == list(NATIVE.values())


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_a_native_codec_validates_what_dequantize_refuses(name: str):
    payload = quantize_weight(torch.randn(4, 64), NATIVE[name])
    codec = registry.codec_for(name)
    codec.check(payload)  # a payload its own quantizer made is consistent
    bad = dataclasses.replace(payload, data=payload.data.view(torch.int8)[:, :-1].contiguous())
    with pytest.raises(ValueError, match=f"^{name} payload `data` must") as by_codec:
        codec.check(bad)
    with pytest.raises(ValueError) as by_dequantize:
        dequantize(bad)
    assert str(by_dequantize.value) == str(by_codec.value)


def test_a_codec_checks_only_payloads_of_its_format():
    payload = quantize_weight(torch.randn(4, 64), "int8")
    with pytest.raises(
        ValueError, match="the int4 codec cannot check a int8 payload; use codec_for"
    ):
        registry.codec_for("int4").check(payload)


def _relabel(payload: QuantPayload, name: str) -> QuantPayload:
    return dataclasses.replace(payload, format=dataclasses.replace(payload.format, name=name))


@pytest.fixture
def toy() -> Iterator[tuple[Codec, list[str]]]:
    """``toy_int8``: the qlens int8 layout under another name and scheme, its dequantize
    recording each call; unregistered afterwards."""
    calls: list[str] = []

    def toy_dequantize(payload: QuantPayload, dtype: torch.dtype) -> torch.Tensor:
        calls.append(payload.format.name)
        return dequantize_int_group(payload, dtype)

    def toy_quantize(weight: torch.Tensor, options: QuantizeOptions) -> QuantPayload:
        int8 = dataclasses.replace(options, scheme="int8")
        return _relabel(quantize_int_group(weight, int8), TOY)

    codec = Codec(
        TOY,
        toy_dequantize,
        validate=validate_int_group,
        quantize=toy_quantize,
        scheme="toy-int8",
        scheme_description="int8 codes under another name",
        quantize_options=("group_size",),
    )
    assert TOY not in registry.known_formats()
    registry.register_codec(codec)
    try:
        yield codec, calls
    finally:
        registry.unregister_codec(TOY)
    assert TOY not in registry.known_formats()
    assert "toy-int8" not in quantize_module.SCHEMES


def test_registering_a_codec_makes_its_format_known_everywhere(toy):
    codec, calls = toy
    assert TOY in registry.known_formats() and registry.codec_for(TOY) is codec
    weight = torch.randn(6, 64)
    payload = quantize_weight(weight, "toy-int8", group_size=32)
    assert payload.format.name == TOY
    int8 = quantize_weight(weight, "int8", group_size=32)
    assert torch.equal(payload.data, int8.data) and torch.equal(payload.scales, int8.scales)
    assert torch.equal(dequantize(payload), dequantize(int8))
    assert torch.equal(qlens.dequantize({"w": payload})["w"], dequantize(int8))
    assert calls == [TOY, TOY]
    assert quantize_module.SCHEMES["toy-int8"] == "int8 codes under another name"
    assert "toy-int8" in model_quantize.SCHEMES
    with pytest.raises(ValueError, match="block_size applies to 'fp8-block' only, not 'toy-int8'"):
        quantize_weight(weight, "toy-int8", block_size=32)
    with pytest.raises(
        ValueError, match="asymmetric=True applies to int4/int8 only, not 'toy-int8'"
    ):
        quantize_weight(weight, "toy-int8", asymmetric=True)


def test_qlens_quantize_swaps_layers_with_a_registered_scheme(toy):
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    quantized = qlens.quantize(model, "toy-int8", group_size=32, skip=[])
    layer = quantized[0]
    assert isinstance(layer, qlens.QuantLinear) and layer.payload.format.name == TOY
    expected = quantize_weight(model[0].weight, "int8", group_size=32)
    assert torch.equal(qlens.dequantize(layer), dequantize(expected))


def test_a_format_and_a_scheme_are_registered_once(toy):
    codec, _ = toy
    with pytest.raises(
        ValueError, match=r"^format 'toy_int8' is already registered \(dequantized by "
    ):
        registry.register_codec(dataclasses.replace(codec, scheme="other"))
    with pytest.raises(ValueError, match="format 'int4' is already registered"):
        registry.register_codec(Codec("int4", dequantize_int_group))
    with pytest.raises(ValueError, match="unregister_codec\\('int4'\\) first to replace it"):
        registry.register_dequantizer("int4")(dequantize_int_group)
    with pytest.raises(
        ValueError, match="quantize scheme 'toy-int8' already quantizes to format 'toy_int8'"
    ):
        registry.register_codec(dataclasses.replace(codec, name="toy_int8_again"))
    assert "toy_int8_again" not in registry.known_formats()


def test_unknown_formats_and_half_defined_codecs_are_refused():
    with pytest.raises(ValueError, match="format 'toy_missing' is not registered"):
        registry.unregister_codec("toy_missing")
    with pytest.raises(
        ValueError, match="no dequantizer for format 'toy_missing'; known formats: "
    ):
        registry.codec_for("toy_missing")
    with pytest.raises(ValueError, match="names a quantize scheme or options but has no quantize"):
        Codec("toy", dequantize_int_group, scheme="toy")
    with pytest.raises(ValueError, match="a codec needs a non-empty format name"):
        Codec("", dequantize_int_group)
    assert Codec("toy", dequantize_int_group, quantize=quantize_int_group).scheme == "toy"


def test_element_scales_are_read_from_the_codec(toy):
    codec, _ = toy
    payload = quantize_weight(torch.randn(4, 64), "toy-int8", group_size=32)
    with pytest.raises(
        ValueError, match=r"element_scales does not know format 'toy_int8'; it knows \["
    ):
        element_scales(payload)
    codec.element_scales = registry.codec_for("int8").element_scales
    expected = payload.scales.repeat_interleave(32, dim=-1)  # one fp32 scale per 32 along K
    assert torch.equal(element_scales(payload), expected)
    assert all(registry.codec_for(n).element_scales is not None for n in NATIVE)


def test_the_formats_without_a_separate_validator_check_their_input_when_dequantized():
    unvalidated = {c.name for c in registry.codecs() if c.validate is None}
    assert unvalidated == {"bnb_nf4", "bnb_fp4", "bnb_int8", "bitnet", "higgs", "nf4_torchao"}


def test_a_gguf_codec_validates_what_dequantize_refuses():
    blocks = torch.zeros(3, 2 * Q8_0.type_size, dtype=torch.uint8)
    payload = gguf_payload(blocks, Q8_0.type_id)
    codec = registry.codec_for("gguf_q8_0")
    codec.check(payload)
    bad = dataclasses.replace(payload, data=blocks[:, :-1])
    message = r"^gguf_q8_0 payload `data` must have shape \[3, 68\], got \[3, 67\]"
    with pytest.raises(ValueError, match=message):
        codec.check(bad)
    with pytest.raises(ValueError, match=message):
        dequantize(bad)
