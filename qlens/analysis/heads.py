"""Head detection: previous-token, duplicate-token and induction scores for every head."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from qlens.analysis.labeled import Labeled

HeadKind = Literal["previous_token", "duplicate_token", "induction"]
HEAD_KINDS: tuple[HeadKind, ...] = ("previous_token", "duplicate_token", "induction")


def repeated_random_tokens(
    d_vocab: int,
    seq_len: int,
    *,
    batch: int = 1,
    seed: int = 0,
    bos_token_id: int | None = None,
    low: int = 0,
) -> Int[Tensor, "batch pos"]:
    """``batch`` random sequences of ``seq_len`` tokens in ``[low, d_vocab)``, each repeated once
    (``[bos] + seq + seq``): the standard probe for induction heads."""
    if not 0 <= low < d_vocab:
        raise ValueError(f"low must be in [0, d_vocab={d_vocab}), got {low}")
    generator = torch.Generator().manual_seed(seed)
    half = torch.randint(low, d_vocab, (batch, seq_len), generator=generator)
    tokens = torch.cat([half, half], dim=1)
    if bos_token_id is not None:
        tokens = torch.cat([torch.full((batch, 1), bos_token_id), tokens], dim=1)
    return tokens


def detection_mask(tokens: Int[Tensor, "batch pos"], kind: str) -> Bool[Tensor, "batch q k"]:
    """Which key positions a head of ``kind`` (one of ``HEAD_KINDS``) attends to from each query
    position."""
    n = tokens.shape[-1]
    q = torch.arange(n, device=tokens.device)[:, None]
    k = torch.arange(n, device=tokens.device)[None, :]
    earlier = (k < q)[None]
    if kind == "previous_token":
        return (k == q - 1)[None].expand(tokens.shape[0], n, n)
    if kind == "duplicate_token":
        return earlier & (tokens[:, None, :] == tokens[:, :, None])
    if kind == "induction":
        previous = torch.roll(tokens, 1, dims=-1)  # previous[k] = tokens[k - 1]
        follows_match = previous[:, None, :] == tokens[:, :, None]
        return earlier & follows_match & (k >= 1)[None]
    raise ValueError(f"unknown head kind {kind!r}; expected one of {', '.join(HEAD_KINDS)}")


def score_patterns(
    patterns: Float[Tensor, "layer batch head q k"],
    tokens: Int[Tensor, "batch pos"],
    kind: str,
) -> Float[Tensor, "layer head"]:
    """Mean attention mass each head puts on the ``kind`` targets, over query positions that
    have at least one target."""
    mask = detection_mask(tokens.to(patterns.device), kind)  # [batch q k]
    eligible = mask.any(-1)  # [batch q]
    if not bool(eligible.any()):
        raise ValueError(f"these tokens have no position with a {kind} target to score")
    mass = (patterns * mask[None, :, None].to(patterns.dtype)).sum(-1)  # [layer batch head q]
    weights = eligible[None, :, None].to(patterns.dtype)
    return (mass * weights).sum((1, 3)) / weights.sum((1, 3))


def head_scores(
    bridge: Any,
    tokens: Int[Tensor, "batch pos"],
    kinds: Sequence[str] = HEAD_KINDS,
) -> dict[str, Labeled]:
    """Run ``tokens`` and score every head for each kind: ``{kind: Labeled[layer head]}``."""
    with torch.no_grad():
        _, cache = bridge.run_with_cache(
            tokens, names_filter=lambda n: n.endswith("attn.hook_pattern")
        )
    patterns = torch.stack(
        [cache[f"blocks.{i}.attn.hook_pattern"] for i in range(bridge.cfg.n_layers)]
    ).float()
    tokens = tokens.to(patterns.device)
    labels = {
        "layer": [str(i) for i in range(patterns.shape[0])],
        "head": [str(h) for h in range(patterns.shape[2])],
    }
    return {
        kind: Labeled(score_patterns(patterns, tokens, kind), ("layer", "head"), labels)
        for kind in kinds
    }
