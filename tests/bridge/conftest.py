"""Fixtures for the bridge tests: architecture parameter, a small word tokenizer, and a check
that no test leaves PyTorch hooks on the shared tiny models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import transformers as T
from bridge_models import ARCHS, drop_hooked_models, make_word_tokenizer


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def word_tokenizer() -> T.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with <pad>=0, <bos>=1, <eos>=2."""
    return make_word_tokenizer()


@pytest.fixture(autouse=True)
def shared_models_stay_unhooked() -> Iterator[None]:
    """The cached tiny models are shared by every test of the process: a test that leaves a
    PyTorch hook on one (its own, or one HF installs for ``output_hidden_states``) fails here,
    instead of a later test that checks the bridge removed its hooks (the hooked model is
    rebuilt for the tests that follow)."""
    yield
    left = drop_hooked_models()
    assert not left, f"this test left PyTorch hooks on shared tiny models: {left[:5]}"
