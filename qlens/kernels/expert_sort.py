"""Routed rows sorted by expert on the device, once for every launch that reads them sorted."""

from __future__ import annotations

import torch
from jaxtyping import Integer
from torch import Tensor

# Below this many experts, ids in range sort as bytes: one radix pass instead of eight for
# int64 ids (and ``arange(experts + 1)`` still fits a byte).
_BYTE_KEY_EXPERTS = 256


def sort_by_expert(
    ids: Integer[Tensor, " rows"], num_experts: int, *, ids_in_range: bool = True
) -> tuple[Integer[Tensor, " rows"], Integer[Tensor, " rows"], Integer[Tensor, " bounds"]]:
    """``(sorted_ids, order, starts)``: the rows' experts sorted (stable), the rows in that
    order, and where each expert's rows start among the sorted rows (int32, ``num_experts + 1``
    entries: ``starts[num_experts]`` counts the rows of ids below ``num_experts``; ``starts[1:]``
    are the ends ``torch._grouped_mm`` takes as offsets). On the device, no host sync.

    ``ids_in_range``: every id lies in ``[0, num_experts)`` (the modules' routing clamps them),
    so fewer than 256 experts sort as bytes. Otherwise the ids sort as they are: rows of ids
    below 0 come before ``starts[0]``, rows of ids ``num_experts`` or more after
    ``starts[num_experts]``, where no expert's range reaches them.
    """
    if ids_in_range:
        keys = ids.to(torch.uint8 if num_experts < _BYTE_KEY_EXPERTS else torch.int32)
    else:
        keys = ids
    sorted_ids, order = torch.sort(keys, stable=True)
    experts = torch.arange(num_experts + 1, dtype=keys.dtype, device=ids.device)
    return sorted_ids, order, torch.searchsorted(sorted_ids, experts, out_int32=True)
