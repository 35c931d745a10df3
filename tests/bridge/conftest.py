"""Fixtures for the bridge tests: architecture parameter and a small word tokenizer."""

from __future__ import annotations

import pytest
import transformers as T
from bridge_models import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def word_tokenizer() -> T.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with <pad>=0, <bos>=1, <eos>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
        *"the cat sat on mat a dog ran to park and".split(),
    ]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return T.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
