"""save_quantized / load_quantized: identical logits after a round trip through safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import input_ids, make_model
from torch import nn

from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.serialization import MANIFEST_FILE, load_quantized, save_quantized


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids()).logits


@pytest.mark.parametrize(
    ("family", "scheme"),
    [("llama", "int4"), ("gpt2", "fp8-block"), ("mixtral", "mxfp4"), ("gpt_oss", "nvfp4")],
)
def test_round_trip_gives_identical_logits(tmp_path: Path, family: str, scheme: str) -> None:
    quantized = quantize(make_model(family), scheme)
    save_quantized(quantized, tmp_path)
    reloaded = load_quantized(tmp_path)
    assert type(reloaded) is type(quantized)
    assert torch.equal(_logits(reloaded), _logits(quantized))
    for name, module in quantized.named_modules():
        if isinstance(module, (QuantLinear, QuantExperts)):
            again = reloaded.get_submodule(name)
            assert type(again) is type(module)
            assert again.payload_specs() == module.payload_specs()


def test_bfloat16_model_round_trip_keeps_dtypes(tmp_path: Path) -> None:
    quantized = quantize(make_model("qwen3_moe").to(torch.bfloat16), "int4", asymmetric=True)
    save_quantized(quantized, tmp_path)
    reloaded = load_quantized(tmp_path)
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    before, after = quantized.state_dict(), reloaded.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert torch.equal(_logits(reloaded), _logits(quantized))


def test_manifest_describes_payloads_and_ties(tmp_path: Path) -> None:
    quantized = quantize(make_model("gpt2"), "int4", group_size=64)
    save_quantized(quantized, tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["model_class"] == "GPT2LMHeadModel"
    entry = manifest["modules"]["transformer.h.0.mlp.c_fc"]
    assert entry["kind"] == "QuantLinear"
    spec = entry["payloads"]["weight"]
    assert spec["shape"] == [256, 128]
    assert spec["format"]["name"] == "int4" and spec["format"]["block"] == [1, 64]
    assert spec["layout"]["packing"] == "qlens"
    # GPT-2 ties lm_head to the token embedding: stored once, tied again on load.
    assert manifest["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    reloaded = load_quantized(tmp_path)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight


def test_loading_a_directory_without_manifest_explains(tmp_path: Path) -> None:
    make_model("llama").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no qlens_quantized\.json.*from_pretrained"):
        load_quantized(tmp_path)


def test_library_quantized_models_are_refused(tmp_path: Path) -> None:
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = make_model("llama")
    model.model.layers[0].mlp.up_proj = FP8Linear(128, 256, block_size=(128, 128))
    with pytest.raises(ValueError, match=r"quantized by a library .*mlp\.up_proj \(FP8Linear\)"):
        save_quantized(model, tmp_path)
