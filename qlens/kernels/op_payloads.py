"""The payloads the ``qlens::`` ops find by their tensors.

A module that keeps a payload offers it here (:func:`offer_to_ops`) with the spec key and the
tensors it passes the ops (the payload's own). An op called with those same tensor objects
(what a compiled graph passes: the module's buffers) and that spec then takes the offered
payload, whose launch plan is kept on it. Otherwise an op that runs outside a CUDA graph
(``torch.compile`` without CUDA graphs, a graph's warm-up and recording, the eager backends)
would build a payload and its plan on every call. Payloads are held weakly: an offer lasts as
long as the module keeps its payload, and the payload keeps the tensors whose ids key it alive,
so no other object can take those ids meanwhile.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from torch import Tensor

from qlens.quant.payload import QuantPayload
from qlens.quant.payload_spec import spec_from_key

_OFFERED: weakref.WeakValueDictionary[tuple[object, ...], QuantPayload] = (
    weakref.WeakValueDictionary()
)


def offer_to_ops(payload: QuantPayload, tensors: Sequence[Tensor], spec: str) -> None:
    """Let the ops called with ``spec`` and exactly ``tensors`` (``payload``'s own, in the
    spec's order) use ``payload``."""
    _OFFERED[(spec, *map(id, tensors))] = payload


def payload_for_op(spec: str, tensors: Sequence[Tensor]) -> QuantPayload:
    """The payload offered with ``spec`` and these tensor objects, else one built from them."""
    offered = _OFFERED.get((spec, *map(id, tensors)))
    return offered if offered is not None else spec_from_key(spec).build(tensors)
