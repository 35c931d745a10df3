"""MoE routing helpers: re-run a family's routing on edited logits; dense <-> top-k weights."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.bridge.adapters.base import RouterScheme


def route(
    logits: Float[Tensor, "tokens experts"], top_k: int, scheme: RouterScheme, renormalize: bool
) -> tuple[Float[Tensor, "tokens k"], Int[Tensor, "tokens k"]]:
    """Top-k mixing weights and expert indices, as the family's router computes them."""
    if scheme == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, indices = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices
    if scheme == "topk_softmax":
        top, indices = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), indices
    raise ValueError(f"unknown router scheme {scheme!r}; use 'softmax_topk' or 'topk_softmax'")


def dense_router_weights(
    weights: Float[Tensor, "tokens k"], indices: Int[Tensor, "tokens k"], n_experts: int
) -> Float[Tensor, "tokens experts"]:
    dense = weights.new_zeros(*weights.shape[:-1], n_experts)
    return dense.scatter(-1, indices, weights)


def sparse_router_weights(
    dense: Float[Tensor, "tokens experts"], indices: Int[Tensor, "tokens k"], name: str
) -> Float[Tensor, "tokens k"]:
    """Back to top-k form; weight on an unselected expert is an error (edit the logits)."""
    unselected = dense.scatter(-1, indices, 0.0)
    if torch.any(unselected != 0):
        raise ValueError(
            f"hook {name!r} put weight on experts the router did not select; the weights can only "
            "re-mix the selected experts. To change which experts are chosen, edit "
            "hook_router_logits instead."
        )
    return dense.gather(-1, indices)
