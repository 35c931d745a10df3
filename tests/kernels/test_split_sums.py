"""K-split outputs: the last program of each tile sums the partials in split order, exactly like
the separate reducing launch, and leaves the arrival counters at zero."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import quantized

from qlens.kernels import LinearConfig, quantized_linear
from qlens.kernels.splits import SPLIT_SUM_ENV, split_target, tile_counters

# Every split launch: packed word GEMV (FMA rows and tensor-core rows), byte-wise GEMV,
# tensor-core split-K, and the W8A8 split-K.
LAUNCHES = (
    ("int4", {"group_size": 32}, False, 1, LinearConfig("gemv", 16, 16, 64, split_k=3)),
    ("nvfp4", {}, False, 9, LinearConfig("gemv", 16, 16, 64, split_k=2)),
    ("fp8-block", {}, False, 2, LinearConfig("gemv", 16, 16, 64, split_k=4)),
    ("mxfp4", {}, False, 5, LinearConfig("splitk", 16, 32, 64, split_k=3)),
    ("fp8-block", {}, True, 3, LinearConfig("splitk", 16, 32, 128, split_k=2)),
)


@pytest.mark.parametrize("scheme, kwargs, w8a8, m, config", LAUNCHES)
def test_in_kernel_sum_equals_reducing_launch(monkeypatch, scheme, kwargs, w8a8, m, config):
    payload = quantized(40, 384, (scheme, kwargs))
    x = torch.randn(m, 384).bfloat16()
    bias = torch.randn(40).bfloat16()
    in_kernel = quantized_linear(x, payload, bias, config=config, w8a8=w8a8)
    assert torch.count_nonzero(tile_counters(x.device, 1)) == 0  # the last programs reset them
    monkeypatch.setenv(SPLIT_SUM_ENV, "0")
    launched = quantized_linear(x, payload, bias, config=config, w8a8=w8a8)
    assert torch.equal(in_kernel, launched)  # same partials, summed in the same order


def test_split_target_shapes_and_switch(monkeypatch):
    out = torch.empty(3, 8)
    unsplit = split_target(out, 1, 4)
    assert unsplit.partials is out and unsplit.stride_split == 0 and not unsplit.in_kernel
    split = split_target(out, 4, 6)
    assert split.partials.shape == (4, 3, 8) and split.partials.dtype == torch.float32
    assert split.in_kernel and split.counters.numel() >= 6 and split.stride_split == 24
    monkeypatch.setenv(SPLIT_SUM_ENV, "0")
    assert not split_target(out, 4, 6).in_kernel


def test_counters_are_kept_and_grown():
    small = tile_counters(torch.device("cpu"), 10)
    assert tile_counters(torch.device("cpu"), 10) is small
    large = tile_counters(torch.device("cpu"), small.numel() + 1)
    assert large.numel() > small.numel() and torch.count_nonzero(large) == 0
    assert tile_counters(torch.device("cpu"), 3) is large
