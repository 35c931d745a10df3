"""HQQ ``HQQLinear`` modules (``hqq`` package): packed ``W_q`` plus a ``meta`` dict."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.hqq import hqq_format
from qlens.quant.libraries import library_of
from qlens.quant.payload import QuantPayload


def _is_hqq_linear(module: nn.Module) -> bool:
    return (
        library_of(module) == "hqq"
        and isinstance(getattr(module, "W_q", None), torch.Tensor)
        and isinstance(getattr(module, "meta", None), dict)
    )


def _zero_and_scale(meta: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    if meta.get("quant_zero") or meta.get("quant_scale"):
        raise NotImplementedError(
            "HQQ weights whose zeros or scales are themselves quantized (quant_zero / "
            "quant_scale, deprecated in hqq 0.2) are not adopted; re-quantize without them"
        )
    if "zero_scale" in meta:  # offloaded meta: zero and scale stacked
        zero, scale = meta["zero_scale"][0], meta["zero_scale"][1]
    else:
        zero, scale = meta["zero"], meta["scale"]
    return zero.detach(), scale.detach()


@register_adopter(
    "HQQ HQQLinear (W_q bit planes + meta zero/scale, 1/2/3/4/8 bits)", _is_hqq_linear
)
def adopt_hqq_linear(module: nn.Module) -> QuantPayload:
    holder: Any = module
    meta: dict[str, Any] = holder.meta
    packing = meta.get("packing")
    if packing is None:
        raise NotImplementedError(
            "HQQ weights quantized with bitpack=False (codes stored as floats) are not adopted"
        )
    zero, scale = _zero_and_scale(meta)
    n, k = (int(s) for s in meta["shape"])
    compute_dtype = meta.get("compute_dtype", torch.float16)  # HQQ's own default
    return QuantPayload(
        format=hqq_format(
            int(meta["nbits"]), int(meta["group_size"]), int(meta["axis"]), scale.dtype
        ),
        data=holder.W_q.detach(),
        shape=(n, k),
        scales=scale,
        zeros=zero,
        layout={
            "packing": "hqq",
            "axis": int(meta["axis"]),
            "view_as_float": bool(meta.get("view_as_float", False)),
            "compute_dtype": str(compute_dtype).removeprefix("torch."),
        },
    )
