"""Fixtures for the bridge tests: architecture parameter and a small word tokenizer."""

from __future__ import annotations

import pytest
import transformers as T
from bridge_models import ARCHS, make_word_tokenizer


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def word_tokenizer() -> T.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with <pad>=0, <bos>=1, <eos>=2."""
    return make_word_tokenizer()
