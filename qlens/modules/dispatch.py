"""The modules' eager forward: calls go to ``qlens.kernels.linear`` and the kept plans
(``traced_experts``: the experts' forward as ``torch.compile`` traces it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.dispatch import ACTIVATION_DTYPES
from qlens.kernels.expert_sort import sort_by_expert
from qlens.kernels.experts import ExpertsPlan
from qlens.kernels.gate_rule import GateRule
from qlens.kernels.plan import linear, require_w8a8
from qlens.kernels.reference import fp8_rounded_activations
from qlens.modules.routing import check_routing, route_to_experts
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
    w8a8_groups: tuple[int, int] | None = None,
    rule: GateRule | None = None,
) -> Float[Tensor, "tokens hidden"]:
    """``down(activate(first(x)))`` of fused ``[experts, out, in]`` payloads (their kept
    ``ExpertsPlan``) for every routed (token, expert) pair, weighted and summed as
    ``route_to_experts`` does (ids outside ``[0, experts of first)`` skipped).

    ``rule``: ``activate`` as the fused decode computes it (``ExpertGate.kernel_rule``), or
    ``None`` when it has no fused form. Few routed rows of packed 4-bit or one-byte experts then
    run in two launches, the routing read in the kernels (``ExpertsPlan.fused_decode``).

    ``w8a8_groups`` (the K blocks of ``first`` and ``down``): each projection's input is
    rounded to FP8 per token and block first (``fp8_rounded_activations``), as W8A8 reads it.

    Where the plans allow (``ExpertsPlan.one_launch``), every row runs at once, one launch a
    projection (packed 4-bit experts: the word-wise GEMV for few rows, the grouped GEMM for
    prefill; one-byte experts: the grouped GEMM), with no host sync: the routing clamps the
    ids. Otherwise each hit expert runs its
    two linears (``qlens.kernels.linear`` on the expert's kept payload view).
    """
    check_routing(hidden_states, top_k_index, top_k_weights)
    if w8a8_groups is None and rule is not None:
        tokens, k = top_k_index.shape
        biases = (first_bias is not None, down_bias is not None)
        fused = first.fused_decode(down, rule, tokens, k, hidden_states.dtype, biases)
        if fused is not None:
            return fused(
                _contiguous(hidden_states), _contiguous(top_k_index), _contiguous(top_k_weights),
                None if first_bias is None else _contiguous(first_bias),
                None if down_bias is None else _contiguous(down_bias),
            )  # fmt: skip
    first_in, down_in = projection_inputs(w8a8_groups)

    def expert_fn(expert: int, x: Tensor) -> Tensor:
        h = linear(first_in(x), first.views[expert], _row(first_bias, expert))
        return linear(down_in(activate(h)), down.views[expert], _row(down_bias, expert))

    def rows_fn(x: Tensor, ids: Tensor) -> Tensor:
        m, dtype = x.shape[0], x.dtype
        first_decoded = first.decoded(m, dtype)
        down_decoded = down.decoded(m, dtype)
        if first_decoded is not None and down_decoded is not None:  # sort the rows once
            sorted_ids, order, starts = sort_by_expert(ids, first.num_experts)
            ends = starts[1:]
            h = first_decoded.on_sorted(first_in(x[order]), ends, first_bias, sorted_ids)
            out = down_decoded.on_sorted(down_in(activate(h)), ends, down_bias, sorted_ids)
            return torch.empty_like(out).index_copy_(0, order, out)
        first_grouped = first.grouped(m, dtype, first_bias is None)
        down_grouped = down.grouped(m, dtype, down_bias is None)
        if first_grouped is not None and down_grouped is not None:  # here too
            _, order, starts = sort_by_expert(ids, first.num_experts)
            h = activate(first_grouped.on_order(first_in(x), first_bias, order, starts))
            return down_grouped.on_order(down_in(h), down_bias, order, starts)
        h = activate(first.rows(first_in(x), ids, first_bias))
        return down.rows(down_in(h), ids, down_bias)

    rows = top_k_index.numel()
    one_launch = first.one_launch(rows) and down.one_launch(rows)
    return route_to_experts(
        hidden_states, top_k_index, top_k_weights, first.num_experts, expert_fn,
        rows_fn if one_launch else None,
    )  # fmt: skip


def _contiguous(x: Tensor) -> Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _as_is(x: Tensor) -> Tensor:
    return x


def _fp8_rounded(group: int, x: Tensor) -> Tensor:
    """``x`` rounded as W8A8 reads it: one Triton launch on a GPU outside compiled graphs
    (inductor fuses the torch ops inside them), the torch reference elsewhere."""
    if x.is_cuda and x.dtype in ACTIVATION_DTYPES and not torch.compiler.is_compiling():
        from qlens.kernels.fp8_w8a8 import fp8_rounded_rows  # Triton: on a GPU only

        return fp8_rounded_rows(x.reshape(-1, x.shape[-1]), group).view(x.shape)
    return fp8_rounded_activations(x, group).to(x.dtype)


def experts_w8a8_groups(first: Any, down: Any) -> tuple[int, int]:
    """The activation blocks of W8A8 experts, each projection's K block (``first``, ``down``:
    payloads or their specs); raises when one of the weights cannot run W8A8."""
    for weight in (first, down):
        require_w8a8(weight.format, weight.shape)
    return first.format.block[1], down.format.block[1]


def projection_inputs(
    w8a8_groups: tuple[int, int] | None,
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """What each projection does to its input first: nothing, or with ``w8a8_groups`` (the
    projections' K blocks) the FP8 rounding of W8A8."""
    if w8a8_groups is None:
        return _as_is, _as_is
    first, down = w8a8_groups
    return functools.partial(_fp8_rounded, first), functools.partial(_fp8_rounded, down)


def _row(bias: Tensor | None, expert: int) -> Tensor | None:
    return None if bias is None else bias[expert]


def check_payload_device(payload: QuantPayload, x: torch.Tensor, owner: str) -> None:
    """Raise when the activations and the packed weight live on different devices."""
    if payload.device != x.device:
        raise RuntimeError(
            f"{owner}: input is on {x.device} but its quantized weight is on {payload.device}; "
            f"move the model with .to({str(x.device)!r}) or the input to {str(payload.device)!r}"
        )
