"""Per-expert views of fused ``[experts, out, in]`` payloads."""

from __future__ import annotations

from dataclasses import replace

import torch

from qlens.quant.payload import QuantPayload


def num_experts_of(payload: QuantPayload) -> int:
    """Leading expert count of a fused ``[experts, out, in]`` payload."""
    if len(payload.shape) != 3:
        raise ValueError(
            f"expected a fused experts payload of shape [experts, out, in]; got {list(payload.shape)}"
        )
    return int(payload.shape[0])


def select_expert(payload: QuantPayload, expert: int) -> QuantPayload:
    """The 2-D ``[out, in]`` payload of one expert (views, no copy).

    Data, scales, zero points and extras carry the leading expert dim; a 0-dim global scale is
    shared by every expert, a 1-D one holds one value per expert.
    """
    count = num_experts_of(payload)
    if not 0 <= expert < count:
        raise IndexError(f"expert {expert} out of range for a payload of {count} experts")

    def pick(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.ndim == 0 or t.shape[0] != count:
            raise ValueError(
                f"payload tensor {name} of shape {list(t.shape)} has no leading expert dim of {count}"
            )
        return t[expert]

    global_scale = payload.global_scale
    if global_scale is not None and global_scale.ndim > 0:
        global_scale = pick(global_scale, "global_scale")
    return replace(
        payload,
        data=pick(payload.data, "data"),
        shape=tuple(payload.shape[1:]),
        scales=None if payload.scales is None else pick(payload.scales, "scales"),
        zeros=None if payload.zeros is None else pick(payload.zeros, "zeros"),
        global_scale=global_scale,
        layout=dict(payload.layout),
        extras={k: pick(v, f"extra.{k}") for k, v in payload.extras.items()},
    )
