"""Helpers shared by the round-to-nearest quantizers of the codecs."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

# The smallest normal e4m3 value: e4m3 block scales are kept at or above it.
E4M3_SMALLEST_NORMAL = 2.0**-6


def group_view(w: Float[Tensor, "*e n k"], group: int) -> Float[Tensor, "*e n g group"]:
    """``[*e, N, K]`` -> zero-padded ``[*e, N, ceil(K/group), group]``."""
    padded = torch.nn.functional.pad(w, (0, -w.shape[-1] % group))
    return padded.unflatten(-1, (-1, group))


def pow2_exponent_floor(x: Tensor) -> Tensor:
    """floor(log2(x)) for positive finite x, exactly (frexp: x = m * 2**e, m in [0.5, 1))."""
    _, exponent = torch.frexp(x)
    return exponent.to(torch.int32) - 1


def round_scale_up(ideal: Tensor, dtype: torch.dtype) -> Tensor:
    """``ideal`` (float64) in ``dtype``, rounded up so that no value exceeds the code range."""
    stored = ideal.to(dtype)
    too_small = stored.double() < ideal
    bumped = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(too_small, bumped, stored)
