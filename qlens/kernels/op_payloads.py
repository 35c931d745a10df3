"""The payloads, and their launch plans, that the ``qlens::`` ops find by their tensors.

A module that keeps a payload offers it here (:func:`offer_to_ops`) with the spec key and the
tensors it passes the ops (the payload's own). An op called with those same tensor objects
(what a compiled graph passes: the module's buffers) and that spec then takes the offered
payload, and a linear op its launch plan (:func:`plan_for_op`), kept on the payload from its
offer on, so a call reaches it in two dictionary look-ups. Otherwise an op that runs outside a
CUDA graph (``torch.compile`` without CUDA graphs, a graph's warm-up and recording, the eager
backends) would build a payload and its plan on every call. Payloads are held weakly: an offer
lasts as long as the module keeps its payload, and the payload keeps the tensors whose ids key
it alive, so no other object can take those ids meanwhile. Offering again (a module does after
``load_state_dict`` or ``forget_prepared``, with the same buffers) starts with no kept plans.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from qlens.kernels import plan
from qlens.quant.payload import QuantPayload
from qlens.quant.payload_spec import spec_from_key

# The plans the ops took for an offered payload, by (device, w8a8), kept on the payload (so no
# longer than it lives) from its latest offer on.
_OP_PLANS = "_qlens_op_plans"

_OFFERED: weakref.WeakValueDictionary[tuple[object, ...], QuantPayload] = (
    weakref.WeakValueDictionary()
)


def offer_to_ops(payload: QuantPayload, tensors: Sequence[Tensor], spec: str) -> None:
    """Let the ops called with ``spec`` and exactly ``tensors`` (``payload``'s own, in the
    spec's order) use ``payload``, and the plans they take for it from now on."""
    payload.__dict__[_OP_PLANS] = {}
    _OFFERED[(spec, *map(id, tensors))] = payload


def payload_for_op(spec: str, tensors: Sequence[Tensor]) -> QuantPayload:
    """The payload offered with ``spec`` and these tensor objects, else one built from them."""
    offered = _OFFERED.get((spec, *map(id, tensors)))
    return offered if offered is not None else spec_from_key(spec).build(tensors)


def plan_for_op(
    spec: str, tensors: Sequence[Tensor], device: torch.device, w8a8: bool = False
) -> plan.LinearPlan:
    """The launch plan (``plan_for``) on ``device`` of the payload offered with ``spec`` and
    these tensor objects, kept until it is offered again; for tensors no payload was offered
    with, the plan of a payload built from them, kept nowhere."""
    offered = _OFFERED.get((spec, *map(id, tensors)))
    if offered is None:
        return plan.plan_for(spec_from_key(spec).build(tensors), device, w8a8=w8a8)
    plans: dict[tuple[torch.device, bool], plan.LinearPlan] = offered.__dict__[_OP_PLANS]
    kept = plans.get((device, w8a8))
    if kept is None:
        kept = plans[device, w8a8] = plan.plan_for(offered, device, w8a8=w8a8)
    return kept
