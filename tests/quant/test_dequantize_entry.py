"""qlens.dequantize accepts payloads, dicts of payloads, QuantLinear-like owners and HF modules."""

from types import SimpleNamespace

import pytest
import torch

from qlens.quant.codecs.registry import known_formats
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight


def test_payload_and_dtype():
    w = torch.randn(8, 64)
    payload = quantize_weight(w, "int8")
    as_fp32 = dequantize(payload)
    assert as_fp32.dtype == torch.float32 and as_fp32.shape == (8, 64)
    assert torch.equal(dequantize(payload, torch.bfloat16), as_fp32.bfloat16())


def test_owner_with_a_payload_attribute_and_dicts_of_payloads():
    gate_up = quantize_weight(torch.randn(2, 8, 32), "mxfp4")
    down = quantize_weight(torch.randn(2, 32, 4), "nvfp4")
    linear_like = SimpleNamespace(payload=gate_up)
    assert torch.equal(dequantize(linear_like), dequantize(gate_up))
    experts_like = SimpleNamespace(payload={"gate_up_proj": gate_up, "down_proj": down})
    out = dequantize(experts_like, torch.float16)
    assert set(out) == {"gate_up_proj", "down_proj"}
    assert out["gate_up_proj"].shape == (2, 8, 32) and out["down_proj"].dtype == torch.float16
    assert torch.equal(out["down_proj"], dequantize(down, torch.float16))


def test_every_owned_format_is_registered():
    assert {"fp8_block", "mxfp8", "mxfp4", "nvfp4", "int2", "int3", "int4", "int8"} <= set(
        known_formats()
    )


def test_hf_quantized_module_goes_through_adoption():
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 32, quant_type="nf4", compute_dtype=torch.float32).to("cpu")
    expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert torch.equal(dequantize(layer), expected.float())


def test_plain_modules_are_not_dequantized_silently():
    with pytest.raises((TypeError, ValueError, NotImplementedError)) as info:
        dequantize(torch.nn.Linear(4, 4))
    assert "Linear" in str(info.value)


def test_registry_skips_absent_codec_modules_but_not_broken_ones(monkeypatch, tmp_path):
    from qlens.quant.codecs import registry

    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_CODEC_MODULES", ("fp8", "not_installed_codec"))
    assert "fp8_block" in registry.known_formats()
    broken = tmp_path / "broken_codec_for_test.py"
    broken.write_text("import a_module_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_CODEC_MODULES", ("fp8",))
    monkeypatch.setattr(
        registry.importlib,
        "import_module",
        lambda name: __import__("broken_codec_for_test"),
    )
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist"):
        registry.known_formats()
