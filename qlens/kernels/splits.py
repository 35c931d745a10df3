"""Output of a K-split launch: each program stores a float32 partial, and the partials are summed
in split order (deterministic) either by the last program of each output tile (``in_kernel``,
one launch) or by a second launch.

In-kernel: every program stores its partial, then bumps its tile's arrival counter (an int32
``atomic_add`` with acquire-release semantics at GPU scope, after a CTA barrier so that every
thread's stores are ordered before it). The program that arrives last sums the tile's partials
in split order, adds the bias, casts, stores and resets the counter to zero. The counters are
therefore zero between launches, and one buffer of them is kept per device and shared by every
split launch there (graph replays included). Launches that share it must not run at the same
time: qlens launches on the current stream only, so it is safe unless split-K products run
concurrently on two streams of one device (set ``QLENS_SPLIT_SUM=0`` for that). A buffer first
needed while a CUDA graph is being captured is allocated, and zeroed by a captured memset, for
that launch only and never kept, since its zeroing runs only when the graph replays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.launch import on_device
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import interpreting
from qlens.quant.codecs.checks import ceil_div

SPLIT_SUM_ENV = "QLENS_SPLIT_SUM"


@triton.jit
@no_type_check
def _finish_tile(total, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
                 HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    n_ok = offs_n < N
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = cast_out(total, out_ptr.dtype.element_ty, INTERPRET)
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


@triton.jit
@no_type_check
def store_tile(total, out_ptr, partial_ptr, counter_ptr, tile_id, bias_ptr, offs_m, offs_n, M, N,
               stride_om, stride_split, pid_k, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
               SPLIT_SUM: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Write a float32 ``[rows, cols]`` tile: plus bias, in the output dtype, when K is not split;
    otherwise as the float32 partial of split ``pid_k``, summed by the tile's last program when
    ``SPLIT_SUM`` (``counter_ptr + tile_id`` counts arrivals) and by ``reduce_splits`` if not.
    ``out`` and the partials share the row stride ``stride_om``."""
    if SPLIT_K == 1:
        _finish_tile(total, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS,
                     INTERPRET)  # fmt: skip
    else:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tile = offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(partial_ptr + pid_k * stride_split + tile, total, mask=mask)
        if SPLIT_SUM:
            tl.debug_barrier()  # every thread's partial is stored before the arrival counts
            arrived = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros_like(total)
                for s in tl.static_range(SPLIT_K):
                    acc += tl.load(partial_ptr + s * stride_split + tile, mask=mask, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
                _finish_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS,
                             INTERPRET)  # fmt: skip
                tl.atomic_xchg(counter_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
@no_type_check
def _reduce_splits_kernel(
    partial_ptr, bias_ptr, out_ptr, M, N, stride_split, stride_pm, stride_om,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Sum the split-K partials in a fixed order (deterministic), add the bias, cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(partial_ptr + s * stride_split + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + m * stride_om + n, cast_out(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask
    )


def reduce_splits(
    partials: Float[Tensor, "split m n"],
    bias: Float[Tensor, " n"] | None,
    out: Float[Tensor, "m n"],
) -> None:
    """``out = sum(partials) + bias``, summed in split order so results are deterministic."""
    split, m, n = partials.shape
    block = 1024
    with on_device(out.device):
        _reduce_splits_kernel[(ceil_div(m * n, block),)](
            partials, bias if bias is not None else out, out, m, n, partials.stride(0), n, n,
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, INTERPRET=interpreting(),
        )  # fmt: skip


_COUNTERS: dict[torch.device, Tensor] = {}


def tile_counters(device: torch.device, count: int) -> Tensor:
    """At least ``count`` zeroed int32 arrival counters on ``device``.

    Kept between calls (the launches leave them zero), except while a CUDA graph is being
    captured and none large enough is kept: then a fresh buffer serves this launch only."""
    key = device
    kept = _COUNTERS.get(key)
    if kept is not None and kept.numel() >= count:
        return kept
    size = max(4096, 1 << max(count - 1, 0).bit_length())
    fresh = torch.zeros(size, dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _COUNTERS[key] = fresh
    return fresh


@dataclass(frozen=True)
class SplitTarget:
    """Where a launch split ``split`` ways along K writes: ``out`` (the result), ``partials``
    (float32 ``[split, m, n]``, or ``out`` when unsplit) and ``counters`` (one per output tile
    when the last program sums, else ``out``)."""

    out: Tensor
    partials: Tensor
    counters: Tensor
    split: int
    in_kernel: bool

    @property
    def stride_split(self) -> int:
        return self.partials.stride(0) if self.split > 1 else 0

    def finish(self, bias: Tensor | None) -> Tensor:
        """The result, after the reducing launch where the kernel did not sum the splits."""
        if self.split > 1 and not self.in_kernel:
            reduce_splits(self.partials, bias, self.out)
        return self.out


def split_target(out: Float[Tensor, "m n"], split: int, tiles: int) -> SplitTarget:
    """The target of a launch over ``tiles`` output tiles, split ``split`` ways along K.

    The last program of each tile sums its partials unless ``QLENS_SPLIT_SUM=0`` asks for a
    separate reducing launch (kept for comparisons)."""
    if split == 1:
        return SplitTarget(out, out, out, 1, False)
    m, n = out.shape
    partials = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    if os.environ.get(SPLIT_SUM_ENV) == "0":
        return SplitTarget(out, partials, out, split, False)
    return SplitTarget(out, partials, tile_counters(out.device, tiles), split, True)
