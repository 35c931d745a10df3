"""Unpacked group-wise integer weights: the common form every integer packing decodes to."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Integer
from torch import Tensor


@dataclass
class IntGroups:
    """Unsigned codes, zero points and scales: ``W[n, k] = (codes - zeros[g]) * scales[g]``.

    ``g = group_index[k]`` (``k // group_size`` unless GPTQ act-order reordered the columns).
    ``zeros`` are in code units (e.g. 8 for symmetric 4-bit).
    """

    codes: Integer[Tensor, "*e n k"]
    scales: Float[Tensor, "*e n g"]
    zeros: Integer[Tensor, "*e n g"]
    group_index: Integer[Tensor, " k"]

    def dequantize(self, dtype: torch.dtype) -> Float[Tensor, "*e n k"]:
        """The weight, computed as ``(codes - zero) * scale`` in fp32 and cast to ``dtype``."""
        index = self.group_index.long()
        zeros = self.zeros.long().index_select(-1, index)
        scales = self.scales.float().index_select(-1, index)
        return ((self.codes.long() - zeros).float() * scales).to(dtype)


def contiguous_group_index(k: int, group_size: int, device: torch.device) -> Integer[Tensor, " k"]:
    """Group of each of ``k`` columns when groups are consecutive runs of ``group_size``."""
    return torch.arange(k, device=device) // group_size


def midpoint(bits: int) -> int:
    """Implicit zero point of symmetric ``bits``-bit unsigned codes."""
    return 1 << (bits - 1)
