"""The experts forward as ``torch.compile`` traces it: ``qlens::`` ops only, no data-dependent
Python. A few tokens' routed experts (a decode step) become one ``qlens::moe_decode`` node,
which runs the fused MoE decode's two launches (``qlens.kernels.moe_decode``); more rows, and
experts the fused decode cannot run, trace to one ``qlens::experts_linear`` per projection with
the gating and the routes' weighted sum between them as torch ops (inductor fuses those).
"""

# No ``from __future__ import annotations``: the op's schema is read from real annotations
# (``qlens.kernels.op_library``).

import functools
from collections.abc import Callable

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.experts import FUSED_EXPERT_ROWS, experts_plan_for
from qlens.kernels.formats import expert_kernel_formats
from qlens.kernels.gate_rule import GateRule
from qlens.kernels.op_library import qlens_op
from qlens.kernels.op_payloads import payload_for_op
from qlens.kernels.ops import compiled_experts_linear
from qlens.modules.dispatch import fused_experts_forward, projection_inputs
from qlens.modules.expert_gate import ExpertGate
from qlens.modules.routing import check_routing, route_to_experts
from qlens.quant.payload_spec import spec_from_key

# Devices whose compiled graphs run few routed rows through ``qlens::moe_decode``.
FUSED_DECODE_DEVICES = frozenset({"cuda"})


@qlens_op("moe_decode")
def _moe_decode(
    x: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    first_tensors: list[Tensor],
    first_spec: str,
    down_tensors: list[Tensor],
    down_spec: str,
    first_bias: Tensor | None,
    down_bias: Tensor | None,
    interleaved: bool,
    activation: str,
    alpha: float,
    limit: float,
) -> Tensor:
    """The routed experts of ``x`` as an eager call runs them (``fused_experts_forward`` on the
    payloads' kept plans, with the gate ``GateRule(interleaved, activation, alpha, limit)``):
    the fused decode's two launches where it runs, the unfused launches otherwise."""
    gate = _gate_of(interleaved, activation, alpha, limit)
    first = experts_plan_for(payload_for_op(first_spec, first_tensors), x.device)
    down = experts_plan_for(payload_for_op(down_spec, down_tensors), x.device)
    return fused_experts_forward(
        x, top_k_index, top_k_weights, first, down, first_bias, down_bias,
        gate.apply, None, gate.kernel_rule,
    )  # fmt: skip


@_moe_decode.register_fake
def _moe_decode_fake(
    x: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    first_tensors: list[Tensor],
    first_spec: str,
    down_tensors: list[Tensor],
    down_spec: str,
    first_bias: Tensor | None,
    down_bias: Tensor | None,
    interleaved: bool,
    activation: str,
    alpha: float,
    limit: float,
) -> Tensor:
    return x.new_empty((x.shape[0], spec_from_key(down_spec).shape[1]))


moe_decode_op = _moe_decode.default  # the op's OpOverload


@functools.cache
def _gate_of(interleaved: bool, activation: str, alpha: float, limit: float) -> ExpertGate:
    """The module gate whose fused form is ``GateRule(interleaved, activation, alpha, limit)``
    (its ``kernel_rule``; its torch form runs the unfused path), built once per rule."""
    swiglu = activation == "clamped_swiglu"
    return ExpertGate(
        "interleaved" if interleaved else "stacked", activation,
        alpha if swiglu else None, limit if swiglu else None,
    )  # fmt: skip


@torch.compiler.assume_constant_result
def _fused_decode_formats(first_key: str, down_key: str, device_type: str) -> bool:
    """Whether both projections' formats run the fused decode on a ``device_type`` device (a
    constant of the trace, decided when it is traced)."""
    readable = expert_kernel_formats()
    return device_type in FUSED_DECODE_DEVICES and all(
        spec_from_key(key).format.name in readable for key in (first_key, down_key)
    )


def traced_experts_forward(
    hidden_states: Float[Tensor, "tokens hidden"],
    top_k_index: Integer[Tensor, "tokens k"],
    top_k_weights: Float[Tensor, "tokens k"],
    first: tuple[list[Tensor], str, int],
    down: tuple[list[Tensor], str],
    first_bias: Float[Tensor, "experts inner"] | None,
    down_bias: Float[Tensor, "experts hidden"] | None,
    activate: Callable[[Tensor], Tensor],
    w8a8_groups: tuple[int, int] | None = None,
    rule: GateRule | None = None,
) -> Float[Tensor, "tokens hidden"]:
    """``fused_experts_forward`` as ``torch.compile`` traces it. ``first`` and ``down`` are
    (payload tensors, spec key[, number of experts]); ``rule``: ``activate``'s fused form, or
    ``None``. Up to ``FUSED_EXPERT_ROWS`` routed rows on a GPU, with a fused gate, no FP8
    activations and no gradient to carry, trace to ``qlens::moe_decode``; otherwise every
    (token, route) row runs at once through ``qlens::experts_linear``."""
    check_routing(hidden_states, top_k_index, top_k_weights)
    (first_tensors, first_key, num_experts), (down_tensors, down_key) = first, down
    if (
        rule is not None
        and w8a8_groups is None
        and top_k_index.numel() <= FUSED_EXPERT_ROWS
        and not _carries_grad(hidden_states, first_bias, down_bias)
        and _fused_decode_formats(first_key, down_key, hidden_states.device.type)
    ):
        return torch.ops.qlens.moe_decode(
            hidden_states, top_k_index, top_k_weights, first_tensors, first_key, down_tensors,
            down_key, first_bias, down_bias, rule.interleaved, rule.activation, rule.alpha,
            rule.limit,
        )  # fmt: skip
    # A partial, not a closure: no function is defined inside the traced region.
    rows_fn = functools.partial(
        _traced_rows, first_tensors, first_key, first_bias, down_tensors, down_key, down_bias,
        activate, *projection_inputs(w8a8_groups),
    )  # fmt: skip
    return route_to_experts(
        hidden_states, top_k_index, top_k_weights, num_experts, _unused_expert_fn, rows_fn
    )


def _carries_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records through these tensors (``qlens::moe_decode`` has no backward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _traced_rows(
    first_tensors: list[Tensor],
    first_key: str,
    first_bias: Tensor | None,
    down_tensors: list[Tensor],
    down_key: str,
    down_bias: Tensor | None,
    activate: Callable[[Tensor], Tensor],
    first_in: Callable[[Tensor], Tensor],
    down_in: Callable[[Tensor], Tensor],
    x: Tensor,
    ids: Tensor,
) -> Tensor:
    h = compiled_experts_linear(first_in(x), ids, first_tensors, first_key, first_bias)
    return compiled_experts_linear(down_in(activate(h)), ids, down_tensors, down_key, down_bias)


def _unused_expert_fn(expert: int, x: Tensor) -> Tensor:
    raise AssertionError("route_to_experts runs rows_fn when given one")
