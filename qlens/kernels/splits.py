"""Output of a K-split launch: each program stores a float32 partial of its K range, and the
partials are summed in split order (deterministic), the bias added and the result cast, either
by a second launch (``reduce_splits``) or, in the packed GEMV's launches on tensor cores when
``LinearConfig.split_sum`` asks (by default in its launches on rows as they are, the eager
calls' one launch), by the last program of each output tile (``sum_tile_splits``).

In the kernel: every program stores its partial, then bumps its tile's int32 arrival counter
(an acquire-release ``atomic_add`` at GPU scope, after a CTA barrier so that every thread's
stores come before it). The program that arrives last sums the tile's partials in split order,
finishes the tile as the reducing launch would (bit for bit) and sets the counter back to zero,
so counters are zero between launches. One buffer of counters is kept per device and stream
(``split_counters``) and shared by the launches there, which the stream serializes. A buffer
first needed while a CUDA graph captures is zeroed by a captured memset and kept by that graph
only. Two launches of one kept buffer may therefore not overlap: only a graph replayed on
another stream than it was captured on, while that stream runs qlens calls, could do that.
Summing in the kernel costs a one-row GEMV's many small programs more than the launch it
saves (``benchmarks/tuning/results/decode_splits_h200.md``, earlier run), so one-row GEMVs and
the byte-wise kernels keep the reducing launch (one-row GEMVs no longer split K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.fast_launch import FastLaunch, PreparedLaunch
from qlens.kernels.launch import on_device
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import capturing_cuda_graph, current_stream, interpreting
from qlens.quant.codecs.checks import ceil_div


@triton.jit
@no_type_check
def store_tile(total, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
               stride_split, pid_k, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """Write a float32 ``[rows, cols]`` tile: plus bias, in the output dtype, when K is not split;
    otherwise as the float32 partial of split ``pid_k`` (``reduce_splits`` finishes it).
    ``out`` and the partials share the row stride ``stride_om``."""
    n_ok = offs_n < N
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    tile = offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + tile, cast_out(total, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        tl.store(partial_ptr + pid_k * stride_split + tile, total, mask=mask)


@triton.jit
@no_type_check
def sum_tile_splits(total, out_ptr, partial_ptr, counter_ptr, bias_ptr, offs_m, offs_n, M, N,
                    stride_om, stride_split, pid_k, HAS_BIAS: tl.constexpr,
                    SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``store_tile`` of split ``pid_k``'s partial, then, in the tile's last program to arrive
    (counted at ``counter_ptr``, one int32 per program of the launch's first two grid axes),
    the split-order sum of the tile's partials, finished as ``store_tile`` finishes an unsplit
    tile; that program resets the counter to zero."""
    store_tile(total, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
               stride_split, pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip
    tl.debug_barrier()  # every thread's partial is stored before the tile counts the arrival
    tile = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        at = offs_m[:, None] * stride_om + offs_n[None, :]
        acc = tl.zeros_like(total)
        for s in tl.static_range(SPLIT_K):  # other SMs wrote them: read through L2
            acc += tl.load(partial_ptr + s * stride_split + at, mask=mask, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
        store_tile(acc, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
                   stride_split, pid_k, HAS_BIAS, 1, INTERPRET)  # fmt: skip
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


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


_REDUCE_BLOCK = 1024
_REDUCE = FastLaunch(_reduce_splits_kernel)


def reduce_splits(
    partials: Float[Tensor, "split m n"],
    bias: Float[Tensor, " n"] | None,
    out: Float[Tensor, "m n"],
) -> None:
    """``out = sum(partials) + bias``, summed in split order so results are deterministic."""
    split, m, n = partials.shape
    with on_device(out.device):
        _REDUCE.launch(
            (ceil_div(m * n, _REDUCE_BLOCK),), partials, bias if bias is not None else out, out,
            m, n, partials.stride(0), n, n, SPLIT_K=split, HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK, INTERPRET=interpreting(),
        )  # fmt: skip


def prepared_reduce(
    split: int, m: int, n: int, has_bias: bool, device: torch.device, placeholder: Tensor
) -> PreparedLaunch:
    """:func:`reduce_splits` of contiguous ``[split, m, n]`` partials into a contiguous ``[m, n]``
    output, prepared once: a call passes ``(partials, bias, out)``, or ``(partials, out)``."""
    args = (placeholder, placeholder, placeholder, m, n, m * n, n, n)
    slots = [0, 1, 2] if has_bias else [0, 2]
    return _REDUCE.prepare(
        (ceil_div(m * n, _REDUCE_BLOCK),), args, slots, device, SPLIT_K=split,
        HAS_BIAS=has_bias, BLOCK=_REDUCE_BLOCK, INTERPRET=interpreting(),
    )  # fmt: skip


@dataclass(frozen=True)
class SplitTarget:
    """Where a launch split ``split`` ways along K writes: ``out`` (the result) and ``partials``
    (float32 ``[split, m, n]``, or ``out`` itself when unsplit)."""

    out: Tensor
    partials: Tensor
    split: int

    @property
    def stride_split(self) -> int:
        return self.partials.stride(0) if self.split > 1 else 0

    def finish(self, bias: Tensor | None) -> Tensor:
        """The result, after the reducing launch when K was split."""
        if self.split > 1:
            reduce_splits(self.partials, bias, self.out)
        return self.out


def split_target(out: Float[Tensor, "m n"], split: int) -> SplitTarget:
    """The target of a launch writing ``out``, split ``split`` ways along K."""
    if split == 1:
        return SplitTarget(out, out, 1)
    m, n = out.shape
    partials = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    return SplitTarget(out, partials, split)


class PreparedSplitLaunch:
    """What the prepared launches of split-K kernels share (the GEMVs, the weight-only
    kernel): the output (and, when K is split, the float32 partials) allocated per call, the
    prepared launch, then the split reduction, unless the launch sums its splits itself
    (``sums``; ``counters``: the tile counters such launches need, 0 for none)."""

    launch: PreparedLaunch
    sums: bool = False
    reduce: PreparedLaunch | None
    counters: int
    out_shape: tuple[int, ...]
    partials_shape: tuple[int, ...] | None
    dtype: torch.dtype
    device: torch.device
    has_bias: bool

    def _prepare_outputs(
        self,
        m: int,
        n: int,
        dtype: torch.dtype,
        has_bias: bool,
        split: int,
        out_shape: tuple[int, ...] | None,
        placeholder: Tensor,
        summed_tiles: int = 0,
        reduced: bool = True,
    ) -> list[int]:
        """Set the output (``out_shape``, default ``[m, n]``, of ``dtype``), the partials of a
        launch split ``split`` ways and, when a launch leaves them to it (``reduced``), their
        prepared reduction; when a launch sums its ``summed_tiles`` tiles' splits itself
        (``sum_tile_splits``), their counters; on ``placeholder``'s device (it stands for the
        reduction's per-call tensors). Returns the launch's slots: ``x`` (argument 0), then the
        bias (5), the output (6) and the partials (7) where it reads them."""
        device = placeholder.device
        self.out_shape, self.dtype, self.device = out_shape or (m, n), dtype, device
        self.has_bias = has_bias
        self.partials_shape = (split, m, n) if split > 1 else None
        self.counters = summed_tiles if split > 1 else 0
        self.reduce = (
            prepared_reduce(split, m, n, has_bias, device, placeholder)
            if split > 1 and reduced
            else None
        )
        return [0, *([5] if has_bias else []), 6, *([7] if split > 1 else [])]

    def __call__(
        self, x: Float[Tensor, "*rows k"], bias: Tensor | None
    ) -> Float[Tensor, "*rows n"]:
        """``x @ W.T + bias`` (``x``: the prepared rows, leading shape and dtype)."""
        return self.run(x if x.is_contiguous() else x.contiguous(), bias)

    def run(
        self,
        x: Tensor,
        bias: Tensor | None,
        ids: Tensor | None = None,
        launch: PreparedLaunch | None = None,
        sums: bool = False,
    ) -> Tensor:
        """Launch ``launch`` (by default the prepared one, summing its splits as ``self.sums``
        says; another sums them as ``sums`` says) on the kernel-ready rows ``x`` (then the
        bias, the output, the partials, the expert ids and the tile counters where the launch
        reads them) and return the output, its splits reduced unless the launch summed them."""
        if launch is None:
            launch, sums = self.launch, self.sums
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        tensors = [x, bias, out] if self.has_bias else [x, out]
        if self.partials_shape is not None:
            partials = torch.empty(self.partials_shape, dtype=torch.float32, device=self.device)
            tensors.append(partials)
        if ids is not None:
            tensors.append(ids)
        if sums:
            tensors.append(split_counters(self.device, self.counters))
        launch(*tensors)
        if not sums and self.reduce is not None:
            if bias is not None:
                self.reduce(partials, bias, out)
            else:
                self.reduce(partials, out)
        return out


_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}
_MIN_COUNTERS = 1024


def split_counters(device: torch.device, count: int) -> Tensor:
    """At least ``count`` zeroed int32 tile counters for a launch on ``device``'s current
    stream (see the module's docstring): kept per device and stream, the launches leaving them
    zero; while a CUDA graph captures and none large enough is kept, a fresh buffer that the
    graph alone keeps."""
    key = (device, current_stream(device))
    kept = _COUNTERS.get(key)
    if kept is not None and kept.numel() >= count:
        return kept
    fresh = torch.zeros(max(_MIN_COUNTERS, count), dtype=torch.int32, device=device)
    if not capturing_cuda_graph(device):
        _COUNTERS[key] = fresh
    return fresh
