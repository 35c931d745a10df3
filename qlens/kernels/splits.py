"""Output of a K-split launch: each program stores a float32 partial of its K range, and a second
launch sums the partials in split order (deterministic), adds the bias and casts.

Summing in the kernel instead (the last program of each tile, found with an int32 arrival
counter) was measured on the H200 and dropped: at most 5% faster on the M = 16 launches, up to
15% slower on the one-row GEMVs, whose many small programs each waited on an atomic
(``benchmarks/results/decode_splits_h200.md``).
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
from qlens.kernels.runtime import interpreting
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
    prepared launch, then the split reduction."""

    launch: PreparedLaunch
    reduce: PreparedLaunch | None
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
    ) -> list[int]:
        """Set the output (``out_shape``, default ``[m, n]``, of ``dtype``), the partials of a
        launch split ``split`` ways and their prepared reduction, on ``placeholder``'s device
        (it stands for the reduction's per-call tensors). Returns the launch's slots: ``x``
        (argument 0), then the bias (5), the output (6) and the partials (7) where it reads them."""
        device = placeholder.device
        self.out_shape, self.dtype, self.device = out_shape or (m, n), dtype, device
        self.has_bias = has_bias
        self.partials_shape = (split, m, n) if split > 1 else None
        self.reduce = (
            prepared_reduce(split, m, n, has_bias, device, placeholder) if split > 1 else None
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
    ) -> Tensor:
        """Launch ``launch`` (by default the prepared one) on the kernel-ready rows ``x`` (then
        the bias, the output, the partials and the expert ids where the launch reads them) and
        return the output."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        tensors = [x, bias, out] if self.has_bias else [x, out]
        if self.partials_shape is not None:
            partials = torch.empty(self.partials_shape, dtype=torch.float32, device=self.device)
            tensors.append(partials)
        if ids is not None:
            tensors.append(ids)
        (launch or self.launch)(*tensors)
        if self.reduce is not None:
            if bias is not None:
                self.reduce(partials, bias, out)
            else:
                self.reduce(partials, out)
        return out
