"""Tiny offline stand-ins for real checkpoints: a random Llama and a word-level tokenizer."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_VOCAB = 64


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: "w0".."w62" map to their index, anything else to [UNK] (63)."""
    vocab = {f"w{i}": i for i in range(TINY_VOCAB - 1)} | {"[UNK]": TINY_VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def make_tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()
