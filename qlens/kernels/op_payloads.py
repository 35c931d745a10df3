"""The payloads the ``qlens::`` ops find by their tensors.

A module that keeps a payload offers it here (:func:`offer_to_ops`) with the tensors it passes
the ops. An op called with those same tensor objects (what a compiled graph passes: the
module's buffers) then takes the offered payload, whose launch plan is kept on it. Otherwise an
op that runs outside a CUDA graph (``torch.compile`` without CUDA graphs, a graph's warm-up
and recording, the eager backends) would build a payload and its plan on every call. Payloads
are held weakly: an offer lasts as long as the module keeps its payload.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from operator import is_

from torch import Tensor

from qlens.quant.payload import QuantPayload
from qlens.quant.payload_spec import spec_from_key

_OFFERED: weakref.WeakValueDictionary[tuple[int, ...], QuantPayload] = weakref.WeakValueDictionary()
_OFFER = "_qlens_op_offer"  # (spec key, tensors) kept on the offered payload


def offer_to_ops(payload: QuantPayload, tensors: Sequence[Tensor], spec: str) -> None:
    """Let the ops called with exactly ``tensors`` and ``spec`` use ``payload``."""
    kept = tuple(tensors)
    payload.__dict__[_OFFER] = (spec, kept)
    _OFFERED[tuple(map(id, kept))] = payload


def payload_for_op(spec: str, tensors: Sequence[Tensor]) -> QuantPayload:
    """The payload offered with these tensor objects and ``spec``, else one built from them."""
    offered = _OFFERED.get(tuple(map(id, tensors)))
    if offered is not None:
        key, kept = offered.__dict__[_OFFER]
        if key == spec and len(kept) == len(tensors) and all(map(is_, kept, tensors)):
            return offered
    return spec_from_key(spec).build(tensors)
