"""Tiny random-weight models and a word tokenizer for the device-split and harvesting tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

_COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**_COMMON),
    "mixtral": lambda: T.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
}
# Eight short examples of different lengths (so batches need padding).
TEXTS = [
    "the cat sat on the mat",
    "a dog ran",
    "the dog ran to the park and the cat sat",
    "cat",
    "a cat and a dog sat on a mat",
    "the park",
    "dog and cat ran to a mat",
    "the mat sat on the cat",
]
WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", *"the cat sat on mat a dog ran to park and".split()]


def tiny_model(arch: str) -> T.PreTrainedModel:
    """A fresh fp32 model with seeded random weights, in eval mode."""
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()


def word_tokenizer() -> T.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with <pad>=0, <bos>=1, <eos>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return T.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def save_tiny(arch: str, directory: Path) -> Path:
    """Save a tiny model and the word tokenizer as a model directory; returns it."""
    tiny_model(arch).save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory


def split_map(n_layers: int, offloaded: set[int], embed: str = "cpu") -> dict[str, str]:
    """A device map keeping the listed layers on "disk" and everything else on "cpu"."""
    layers = {f"model.layers.{i}": "disk" if i in offloaded else "cpu" for i in range(n_layers)}
    return {
        "model.embed_tokens": embed,
        "model.rotary_emb": "cpu",
        **layers,
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
