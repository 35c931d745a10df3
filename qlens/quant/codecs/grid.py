"""Broadcast per-group or per-block scale grids onto the elements they scale."""

from __future__ import annotations

from jaxtyping import Shaped
from torch import Tensor


def expand_groups(
    scales: Shaped[Tensor, "*e r g"], group: int, length: int
) -> Shaped[Tensor, "*e r length"]:
    """Repeat each per-group entry ``group`` times along the last dim and cut to ``length``."""
    return scales.repeat_interleave(group, dim=-1)[..., :length]


def expand_blocks(
    scales: Shaped[Tensor, "*e gr gc"], block: tuple[int, int], rows: int, cols: int
) -> Shaped[Tensor, "*e rows cols"]:
    """Repeat each block entry over its ``block`` tile; a ragged last tile is cut (ceil-div grid)."""
    expanded = scales.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return expand_groups(expanded, block[1], cols)
