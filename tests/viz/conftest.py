"""A tiny random Llama behind a Bridge with a word-level tokenizer, and its cached run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
PROMPT = "a b c d a b c"


def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="h"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="h")


@pytest.fixture(scope="module")
def tiny_bridge():
    from qlens import Bridge

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    bridge = Bridge(LlamaForCausalLM(config).eval(), tokenizer=_tokenizer())
    # The word-level tokenizer has no BOS token: strings are tokenized as they are.
    bridge.cfg = dataclasses.replace(bridge.cfg, default_prepend_bos=False)
    return bridge


@pytest.fixture(scope="module")
def tiny_run(tiny_bridge):
    """``(logits, cache, str_tokens)`` of the tiny bridge on PROMPT."""
    logits, cache = tiny_bridge.run_with_cache(PROMPT)
    return logits, cache, tiny_bridge.to_str_tokens(PROMPT)
