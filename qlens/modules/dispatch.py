"""The modules' forward: eager calls go to ``qlens.kernels.linear``, traced ones to the ops."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.experts import ExpertsPlan
from qlens.kernels.ops import compiled_experts_linear
from qlens.kernels.plan import linear
from qlens.modules.routing import route_to_experts
from qlens.quant.payload import QuantPayload


def fused_experts_forward(
    hidden_states: Float[Tensor, "tokens hidden"],
    top_k_index: Integer[Tensor, "tokens k"],
    top_k_weights: Float[Tensor, "tokens k"],
    first: ExpertsPlan,
    down: ExpertsPlan,
    first_bias: Float[Tensor, "experts inner"] | None,
    down_bias: Float[Tensor, "experts hidden"] | None,
    activate: Callable[[Tensor], Tensor],
) -> Float[Tensor, "tokens hidden"]:
    """``down(activate(first(x)))`` of fused ``[experts, out, in]`` payloads (their kept
    ``ExpertsPlan``) for every routed (token, expert) pair, weighted and summed as
    ``route_to_experts`` does (ids outside ``[0, experts of first)`` skipped).

    Where the plans allow (``ExpertsPlan.one_launch``), every row runs at once, one launch a
    projection (packed 4-bit experts: the word-wise GEMV for few rows, the grouped GEMM for
    prefill; one-byte experts: the grouped GEMM), with no host sync: the routing clamps the
    ids. Otherwise each hit expert runs its
    two linears (``qlens.kernels.linear`` on the expert's kept payload view).
    """

    def expert_fn(expert: int, x: Tensor) -> Tensor:
        h = linear(x, first.views[expert], _row(first_bias, expert))
        return linear(activate(h), down.views[expert], _row(down_bias, expert))

    def rows_fn(x: Tensor, ids: Tensor) -> Tensor:
        return down.rows(activate(first.rows(x, ids, first_bias)), ids, down_bias)

    rows = top_k_index.numel()
    one_launch = first.one_launch(rows) and down.one_launch(rows)
    return route_to_experts(
        hidden_states, top_k_index, top_k_weights, first.num_experts, expert_fn,
        rows_fn if one_launch else None,
    )  # fmt: skip


def traced_experts_forward(
    hidden_states: Float[Tensor, "tokens hidden"],
    top_k_index: Integer[Tensor, "tokens k"],
    top_k_weights: Float[Tensor, "tokens k"],
    first: tuple[list[Tensor], str, int],
    down: tuple[list[Tensor], str],
    first_bias: Float[Tensor, "experts inner"] | None,
    down_bias: Float[Tensor, "experts hidden"] | None,
    activate: Callable[[Tensor], Tensor],
) -> Float[Tensor, "tokens hidden"]:
    """``fused_experts_forward`` as ``torch.compile`` traces it: every (token, route) row at once
    through the ``qlens::experts_linear`` op, no data-dependent Python. ``first`` and ``down``
    are (payload tensors, spec key[, number of experts])."""
    (first_tensors, first_key, num_experts), (down_tensors, down_key) = first, down
    # A partial, not a closure: no function is defined inside the traced region.
    rows_fn = functools.partial(
        _traced_rows, first_tensors, first_key, first_bias, down_tensors, down_key, down_bias,
        activate,
    )  # fmt: skip
    return route_to_experts(
        hidden_states, top_k_index, top_k_weights, num_experts, _unused_expert_fn, rows_fn
    )


def _traced_rows(
    first_tensors: list[Tensor],
    first_key: str,
    first_bias: Tensor | None,
    down_tensors: list[Tensor],
    down_key: str,
    down_bias: Tensor | None,
    activate: Callable[[Tensor], Tensor],
    x: Tensor,
    ids: Tensor,
) -> Tensor:
    h = compiled_experts_linear(x, ids, first_tensors, first_key, first_bias)
    return compiled_experts_linear(activate(h), ids, down_tensors, down_key, down_bias)


def _unused_expert_fn(expert: int, x: Tensor) -> Tensor:
    raise AssertionError("route_to_experts runs rows_fn when given one")


def _row(bias: Tensor | None, expert: int) -> Tensor | None:
    return None if bias is None else bias[expert]


def check_payload_device(payload: QuantPayload, x: torch.Tensor, owner: str) -> None:
    """Raise when the activations and the packed weight live on different devices."""
    if payload.device != x.device:
        raise RuntimeError(
            f"{owner}: input is on {x.device} but its quantized weight is on {payload.device}; "
            f"move the model with .to({str(x.device)!r}) or the input to {str(payload.device)!r}"
        )
