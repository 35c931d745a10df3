"""Fixtures for the model-loading tests: a saved tiny Llama, and SmolLM2 loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_fixtures import make_tiny_llama, make_tiny_tokenizer


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    """A saved tiny Llama (fp32 safetensors) with its tokenizer."""
    directory = tmp_path / "tiny-llama"
    make_tiny_llama().save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once per test session (converted on first use)."""
    import qlens

    return qlens.load()
