"""Routed rows sorted by expert: the order and each expert's start that the grouped launches
and ``torch._grouped_mm`` read."""

from __future__ import annotations

import pytest
import torch

from qlens.kernels.expert_sort import sort_by_expert


@pytest.mark.parametrize(
    ("num_experts", "key_dtype"), [(5, torch.uint8), (255, torch.uint8), (256, torch.int32)]
)
def test_ids_in_range_sort_stably_with_each_experts_start(num_experts, key_dtype):
    """Byte keys below 256 experts, int32 from there: a stable order, and each expert's first
    sorted row (experts without rows start where the next one does; the last entry counts
    every row, so ``starts[1:]`` are ``torch._grouped_mm``'s ends)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, num_experts, (500,), generator=gen)
    ids[ids == 1] = 2  # expert 1 unused
    sorted_ids, order, starts = sort_by_expert(ids, num_experts)
    assert sorted_ids.dtype == key_dtype
    assert torch.equal(order, torch.sort(ids, stable=True).indices)
    assert torch.equal(sorted_ids.long(), ids[order])
    counts = torch.bincount(ids, minlength=num_experts)
    assert starts.dtype == torch.int32 and starts.shape == (num_experts + 1,)
    assert starts[0] == 0 and torch.equal(starts[1:].long(), counts.cumsum(0))


def test_ids_not_known_in_range_keep_out_of_range_rows_outside_every_expert():
    """Ids not known to lie in range sort as they are: rows of ids below 0 or past the last
    expert fall outside every expert's range (the grouped kernel leaves them unwritten)."""
    ids = torch.tensor([2, 0, 2, 7, -1, 0, 2, 3])
    sorted_ids, order, starts = sort_by_expert(ids, 5, ids_in_range=False)
    assert order.tolist() == [4, 1, 5, 0, 2, 6, 7, 3]
    assert sorted_ids.tolist() == [-1, 0, 0, 2, 2, 2, 3, 7]
    assert starts.tolist() == [1, 3, 3, 6, 7, 7]
    assert starts.dtype == torch.int32
