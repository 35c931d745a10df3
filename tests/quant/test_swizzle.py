"""SWIZZLE_32_4_4 against torchao's to_blocked / from_blocked and the documented offsets."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.quant.codecs.swizzle import swizzle_32_4_4, swizzled_shape, unswizzle_32_4_4

mx_utils = pytest.importorskip("torchao.prototype.mx_formats.utils")


@given(st.integers(1, 300), st.integers(1, 11), st.randoms(use_true_random=False))
def test_swizzle_matches_torchao_and_round_trips(rows, cols, rnd):
    grid = torch.tensor(
        [[rnd.randrange(256) for _ in range(cols)] for _ in range(rows)], dtype=torch.uint8
    )
    swizzled = swizzle_32_4_4(grid)
    assert swizzled.shape == swizzled_shape(rows, cols)
    assert torch.equal(swizzled.flatten(), mx_utils.to_blocked(grid))
    assert torch.equal(unswizzle_32_4_4(swizzled, rows, cols), grid)
    assert torch.equal(mx_utils.from_blocked(swizzled, rows, cols), grid)


def test_swizzle_offsets_follow_the_tile_formula():
    rows, cols = 260, 9
    grid = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)
    flat = swizzle_32_4_4(grid).flatten()
    col_tiles = -(-cols // 4)
    for r, c in [(0, 0), (33, 2), (127, 3), (128, 4), (259, 8), (70, 5)]:
        offset = (
            ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        )
        assert flat[offset].item() == grid[r, c].item()


def test_swizzle_keeps_expert_dims():
    grid = torch.randint(0, 255, (3, 130, 5), dtype=torch.uint8)
    swizzled = swizzle_32_4_4(grid)
    assert swizzled.shape == (3, *swizzled_shape(130, 5))
    for e in range(3):
        assert torch.equal(swizzled[e], swizzle_32_4_4(grid[e]))
    assert torch.equal(unswizzle_32_4_4(swizzled, 130, 5), grid)


def test_unswizzle_rejects_a_container_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"must end in shape \[64, 16\], got \[32, 16\]"):
        unswizzle_32_4_4(torch.zeros(32, 16, dtype=torch.uint8), 200, 3)
