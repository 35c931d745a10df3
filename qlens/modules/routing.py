"""The top-k expert loop shared by every fused-experts forward qlens provides."""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.experts import host_routing_under_capture
from qlens.kernels.runtime import capturing_cuda_graph

ExpertFn = Callable[[int, Tensor], Tensor]
RowsFn = Callable[[Tensor, Tensor], Tensor]


def check_routing(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> None:
    """Raise unless the routing is ``[tokens, hidden]``, ``[tokens, k]``, ``[tokens, k]``."""
    if (
        top_k_index.shape != top_k_weights.shape
        or top_k_index.ndim != 2
        or hidden_states.ndim != 2
        or top_k_index.shape[0] != hidden_states.shape[0]
    ):
        raise ValueError(
            f"routing shapes disagree: hidden_states {list(hidden_states.shape)}, top_k_index "
            f"{list(top_k_index.shape)}, top_k_weights {list(top_k_weights.shape)}; expected "
            f"[tokens, hidden], [tokens, k], [tokens, k]"
        )


def route_to_experts(
    hidden_states: Float[Tensor, "tokens hidden"],
    top_k_index: Integer[Tensor, "tokens k"],
    top_k_weights: Float[Tensor, "tokens k"],
    num_experts: int,
    expert_fn: ExpertFn,
    rows_fn: RowsFn | None = None,
) -> Float[Tensor, "tokens hidden"]:
    """``sum_k top_k_weights[t, k] * expert_fn(top_k_index[t, k], hidden_states[t])`` per token.

    The same semantics as transformers' fused experts modules: ids outside ``[0, num_experts)``
    (the masked or other-rank routes) are skipped; each expert runs once on all its tokens. Sums
    accumulate in float32 and are cast back to ``hidden_states.dtype``.

    ``rows_fn(rows, ids)``, when given, computes every (token, route) pair at once instead, row
    ``i`` of ``rows`` through expert ``ids[i]`` (one kernel launch per projection, no per-expert
    loop); skipped routes then run expert 0 with a zero weight, and each token's routes are
    weighted and summed by one batched product.

    The shapes are the caller's to check (``check_routing``), once, where a forward enters.
    """
    if rows_fn is not None:
        tokens, k = top_k_index.shape
        safe = top_k_index.clamp(0, num_experts - 1)  # skipped routes: expert 0, weight 0
        scale = top_k_weights.masked_fill(safe != top_k_index, 0).to(hidden_states.dtype)
        rows = hidden_states[:, None].expand(tokens, k, -1).reshape(tokens * k, -1)
        rows_out = rows_fn(rows, safe.reshape(-1)).view(tokens, k, -1)
        # [tokens, 1, k] @ [tokens, k, hidden]: one product, accumulated in float32 (bf16 and
        # fp16 matmuls accumulate so), rounded once.
        summed = torch.bmm(scale[:, None].to(rows_out.dtype), rows_out).view(tokens, -1)
        return summed.to(hidden_states.dtype)
    if capturing_cuda_graph(hidden_states.device):
        raise host_routing_under_capture(
            "these experts run one expert at a time (their format, layout or device has no "
            "one-launch path)"
        )
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    with torch.no_grad():
        hit = torch.unique(top_k_index)
    for expert in hit.tolist():
        if not 0 <= expert < num_experts:
            continue
        token_idx, k_pos = torch.where(top_k_index == expert)
        expert_out = expert_fn(expert, hidden_states[token_idx])
        weighted = expert_out * top_k_weights[token_idx, k_pos, None].to(expert_out.dtype)
        out.index_add_(0, token_idx, weighted.to(torch.float32))
    return out.to(hidden_states.dtype)
