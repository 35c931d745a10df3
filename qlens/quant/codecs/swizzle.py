"""SWIZZLE_32_4_4: the 128x4-tile scale layout of cuBLAS/CUTLASS block-scaled matmuls.

A row-major scale grid ``S[R, C]`` is zero-padded to ``[128*ceil(R/128), 4*ceil(C/4)]`` and cut
into 128x4 tiles stored one after another (row-major over tiles, 512 bytes each). Inside a tile,
scale ``(r, c)`` with ``r = 32*a + b`` lands at offset ``b*16 + a*4 + c``. The container has shape
``[32*ceil(R/128), 16*ceil(C/4)]`` (torchao's), with any leading expert dims kept.
"""

from __future__ import annotations

from jaxtyping import Shaped
from torch import Tensor

from qlens.quant.codecs.checks import ceil_div

SWIZZLE_32_4_4 = "32_4_4"


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Container shape of a swizzled ``[rows, cols]`` scale grid."""
    return 32 * ceil_div(rows, 128), 16 * ceil_div(cols, 4)


def swizzle_32_4_4(scales: Shaped[Tensor, "*e r c"]) -> Shaped[Tensor, "*e sr sc"]:
    """Row-major scales -> SWIZZLE_32_4_4 container (padding entries are zero bytes)."""
    *lead, rows, cols = scales.shape
    rb, cb = ceil_div(rows, 128), ceil_div(cols, 4)
    padded = scales.new_zeros((*lead, rb * 128, cb * 4))
    padded[..., :rows, :cols] = scales
    tiles = padded.view(*lead, rb, 4, 32, cb, 4)  # row = (tile_row, a, b); col = (tile_col, c)
    n = len(lead)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)  # -> tile_row, tile_col, b, a, c
    return tiles.permute(order).reshape(*lead, *swizzled_shape(rows, cols))


def unswizzle_32_4_4(
    swizzled: Shaped[Tensor, "*e sr sc"], rows: int, cols: int
) -> Shaped[Tensor, "*e r c"]:
    """Inverse of :func:`swizzle_32_4_4`: the row-major ``[rows, cols]`` grid."""
    *lead, _, _ = swizzled.shape
    rb, cb = ceil_div(rows, 128), ceil_div(cols, 4)
    expected = swizzled_shape(rows, cols)
    if tuple(swizzled.shape[-2:]) != expected:
        raise ValueError(
            f"a SWIZZLE_32_4_4 container for a {rows}x{cols} scale grid must end in shape "
            f"{list(expected)}, got {list(swizzled.shape)}; check the weight shape or pass "
            "row-major scales with layout['scale_swizzle'] = 'none'"
        )
    tiles = swizzled.reshape(*lead, rb, cb, 32, 4, 4)  # tile_row, tile_col, b, a, c
    n = len(lead)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)  # -> tile_row, a, b, tile_col, c
    grid = tiles.permute(order).reshape(*lead, rb * 128, cb * 4)
    return grid[..., :rows, :cols]
