"""Mixture-of-experts linears: tokens grouped by expert, one quantized linear per used expert."""

from __future__ import annotations

from dataclasses import replace

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.dispatch import quantized_linear
from qlens.quant.payload import QuantPayload


def expert_payload(payload: QuantPayload, expert: int) -> QuantPayload:
    """The 2-D ``[out, in]`` payload of one expert of an ``[experts, out, in]`` payload."""
    if len(payload.shape) != 3:
        raise ValueError(
            f"expert payloads have shape [experts, out, in], got {list(payload.shape)}"
        )
    g = payload.global_scale
    if g is not None and g.numel() > 1:
        g = g.reshape(-1)[expert]
    return replace(
        payload,
        data=payload.data[expert],
        shape=tuple(payload.shape[1:]),
        scales=None if payload.scales is None else payload.scales[expert],
        zeros=None if payload.zeros is None else payload.zeros[expert],
        global_scale=g,
        extras={},
    )


def experts_linear(
    x: Float[Tensor, "t k"],
    payload: QuantPayload,
    expert_ids: Integer[Tensor, " t"],
    bias: Float[Tensor, "e n"] | None = None,
    *,
    w8a8: bool = False,
) -> Float[Tensor, "t n"]:
    """``out[t] = x[t] @ W[expert_ids[t]].T + bias[expert_ids[t]]`` for an experts payload.

    Tokens are sorted by expert and each used expert runs ``quantized_linear`` once on its
    tokens (one launch per used expert; the dispatcher picks each launch's path by its count).
    """
    experts, n, k = (int(s) for s in payload.shape)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [tokens, {k}], got {list(x.shape)}")
    if expert_ids.shape != (x.shape[0],):
        raise ValueError(
            f"expert_ids must hold one expert per token, shape [{x.shape[0]}], got "
            f"{list(expert_ids.shape)}"
        )
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= experts):
        raise ValueError(
            f"expert_ids must lie in [0, {experts}), got range "
            f"[{int(expert_ids.min())}, {int(expert_ids.max())}]"
        )
    out = x.new_empty((x.shape[0], n))
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = order[start : start + count]
            b = None if bias is None else bias[expert]
            out[rows] = quantized_linear(x[rows], expert_payload(payload, expert), b, w8a8=w8a8)
            start += count
    return out
