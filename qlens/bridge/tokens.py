"""Tokenization helpers: strings <-> token tensors with padding and BOS handling."""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor, nn

PaddingSide = Literal["left", "right"]


def require_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise ValueError(
            "this bridge has no tokenizer, so it cannot take strings; pass tokenizer= to "
            "Bridge(model, tokenizer) or give token ids as a tensor"
        )
    return tokenizer


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer itself starts every encoding with its BOS token."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def has_bos_candidate(tokenizer: Any) -> bool:
    """Whether the tokenizer has a token to prepend as BOS (its BOS, else its EOS)."""
    return tokenizer.bos_token_id is not None or tokenizer.eos_token_id is not None


def bos_token_id(tokenizer: Any) -> int:
    """The BOS id to prepend: the tokenizer's BOS, else its EOS (as TransformerLens does)."""
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError(
        "prepend_bos=True but the tokenizer has neither a BOS nor an EOS token; "
        "pass prepend_bos=False"
    )


def _token_ids(tokenizer: Any, text: str, prepend_bos: bool | None, prepends: bool) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"expected strings to tokenize, got {type(text).__name__}")
    ids = list(tokenizer(text)["input_ids"])
    if prepend_bos is None:
        return ids
    if prepend_bos and not prepends:
        return [bos_token_id(tokenizer), *ids]
    if not prepend_bos and prepends:
        return ids[1:]
    return ids


def tokenize(
    tokenizer: Any,
    texts: list[str],
    prepend_bos: bool | None,
    padding_side: PaddingSide,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Token ids and attention mask (1 = real token) for a batch of strings.

    As TransformerLens: each string gets exactly one BOS at its start when ``prepend_bos``
    (whether or not the tokenizer adds one itself) and none when False; ``None`` keeps what
    the tokenizer makes.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    prepends = tokenizer_prepends_bos(tokenizer)
    rows = [_token_ids(tokenizer, text, prepend_bos, prepends) for text in texts]
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


def default_padding_side(tokenizer: Any) -> PaddingSide:
    """The tokenizer's padding side (``"right"`` when it sets none)."""
    side = getattr(tokenizer, "padding_side", None)
    return side if side in ("left", "right") else "right"


def positions_from_mask(mask: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """Position ids counting only real tokens (so padded rows match unpadded runs)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def token_device(embed: nn.Module) -> torch.device:
    """Where token ids go: the embedding's device, or its execution device when offloaded."""
    hf_hook = getattr(embed, "_hf_hook", None)
    execution_device = getattr(hf_hook, "execution_device", None)
    if execution_device is not None:
        return torch.device(execution_device)
    device = next(embed.parameters()).device
    if device.type == "meta":
        raise RuntimeError(
            "the token embedding is on the meta device and no accelerate hook says where it "
            "runs; load the model with its weights materialized or dispatch it with accelerate"
        )
    return device
