"""Tokenization helpers: strings <-> token tensors with padding and BOS handling."""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

PaddingSide = Literal["left", "right"]


def require_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise ValueError(
            "this bridge has no tokenizer, so it cannot take strings; pass tokenizer= to "
            "Bridge(model, tokenizer) or give token ids as a tensor"
        )
    return tokenizer


def tokenize(
    tokenizer: Any,
    texts: list[str],
    prepend_bos: bool | None,
    padding_side: PaddingSide,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Token ids and attention mask (1 = real token) for a batch of strings.

    ``prepend_bos=None`` keeps the tokenizer's own special-token behaviour; True/False force a
    single BOS at the start or none.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    rows = []
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"expected strings to tokenize, got {type(text).__name__}")
        ids = tokenizer(text, add_special_tokens=prepend_bos is None)["input_ids"]
        if prepend_bos:
            bos = tokenizer.bos_token_id
            if bos is None:
                raise ValueError(
                    "prepend_bos=True but the tokenizer has no bos_token_id; use prepend_bos=False"
                )
            ids = [bos, *ids]
        rows.append(list(ids))
    if not all(rows):
        raise ValueError(
            "a string tokenized to zero tokens; pass non-empty text or prepend_bos=True"
        )
    length = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    if pad is None:  # masked out, so any id works; prefer EOS as HF generation does
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    tokens = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(length - len(row), length) if padding_side == "left" else slice(0, len(row))
        tokens[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return tokens, mask


def positions_from_mask(mask: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """Position ids counting only real tokens (so padded rows match unpadded runs)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
