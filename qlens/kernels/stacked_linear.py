"""Several quantized linears of one row, stacked: what ``qlens::sibling_linear`` runs.

A compiled graph whose one-row linears read the same row (q/k/v, gate/up) calls one op for
them (``qlens.kernels.sibling_fusion``). On the kernel route the products come from one
:class:`~qlens.kernels.sibling_gemv.SiblingGemv` launch, prepared on the first call and kept on
the first payload while every payload keeps its tensors; otherwise (the torch reference route,
weights that cannot share a launch, several rows) each linear runs as an eager call does and the
outputs are concatenated.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.dispatch import ACTIVATION_DTYPES
from qlens.kernels.plan import linear, plan_for
from qlens.kernels.weights import payload_sources
from qlens.quant.payload import QuantPayload

if TYPE_CHECKING:
    from qlens.kernels.sibling_gemv import SiblingGemv

logger = logging.getLogger(__name__)
_KEPT = "_qlens_sibling_launches"


def stacked_linear(
    x: Float[Tensor, "*batch k"],
    payloads: Sequence[QuantPayload],
    biases: Sequence[Tensor | None],
) -> Float[Tensor, "*batch n"]:
    """``cat([x @ W_i.T + b_i for each payload], -1)``, in one launch where the weights allow."""
    one_row = x.numel() == x.shape[-1]
    launch = _kept_launch(x.device, x.dtype, payloads, biases) if one_row else None
    if launch is not None:
        return launch.stacked(x if x.is_contiguous() else x.contiguous(), _present(biases))
    return torch.cat([linear(x, p, b) for p, b in zip(payloads, biases, strict=True)], dim=-1)


def _present(biases: Sequence[Tensor | None]) -> list[Tensor] | None:
    """The biases when every sibling has one (a shared launch has all or none), else None."""
    present = [b for b in biases if b is not None]
    return present or None


def _sources(payloads: Sequence[QuantPayload]) -> tuple[object, ...]:
    return tuple(t for p in payloads for t in (p, *payload_sources(p)))


def _kept_launch(
    device: torch.device,
    dtype: torch.dtype,
    payloads: Sequence[QuantPayload],
    biases: Sequence[Tensor | None],
) -> SiblingGemv | None:
    """The shared launch for these payloads, one row of ``dtype`` on ``device``, kept on the
    first payload, or None (each linear then runs on its own)."""
    has_bias = biases[0] is not None
    if dtype not in ACTIVATION_DTYPES or any((b is not None) != has_bias for b in biases):
        return None
    first = payloads[0]
    kept: dict[tuple[object, ...], tuple[tuple[object, ...], SiblingGemv | None]]
    kept = first.__dict__.setdefault(_KEPT, {})
    key = (*map(id, payloads[1:]), device, dtype, has_bias)
    sources = _sources(payloads)
    entry = kept.get(key)
    if entry is not None and all(a is b for a, b in zip(entry[0], sources, strict=True)):
        return entry[1]
    from qlens.kernels.sibling_gemv import plans_gemv  # Triton: a launch is prepared

    plans = [plan_for(p, device) for p in payloads]
    built = plans_gemv(plans, dtype, has_bias, device)
    if isinstance(built, str):
        logger.debug("no shared launch for %d linears: %s", len(payloads), built)
    launch = None if isinstance(built, str) else built
    kept[key] = (sources, launch)
    return launch
