"""Prefill rows through experts decoded once per call: every expert's weight decoded by one
Triton dequantize launch over the experts' stacked rows, then torch's grouped GEMM
(``torch._grouped_mm``, CUTLASS on Hopper) over the rows sorted by expert.

This is the dense prefill's route (decode the weight, then cuBLAS) for experts: at prefill
row counts the grouped GEMM on tensor cores in bf16 outruns qlens' grouped kernel, which decodes
each weight tile again for every tile of rows (``benchmarks/results/moe_prefill_*.md``)."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.expert_sort import sort_by_expert
from qlens.kernels.layout_view import KernelWeight
from qlens.kernels.packed_words import ExpertStrides
from qlens.kernels.runtime import cuda_index

# From this many (token, expert) rows per expert on average, bf16 rows take the decoded route;
# fewer keep qlens' grouped kernel: decoding every expert costs the same at any row count, while
# the grouped kernel's time falls with the rows. On the H100 (benchmarks/results/
# moe_prefill_h100.md) the rule picks the faster route at each row count timed: 64 experts at
# 1024, 4096 and 8192 rows, 128 experts at 4096 and 8192.
DECODED_EXPERTS_MIN_ROWS_PER_EXPERT = 64
# torch._grouped_mm's fast kernels: bf16 on these compute capabilities (elsewhere it loops).
_GROUPED_MM_MAJORS = (9, 10)


def grouped_mm_device(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs its grouped kernel (no host loop) on ``device``."""
    return device.type == "cuda" and _cuda_major(cuda_index(device)) in _GROUPED_MM_MAJORS


@functools.cache
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def stacked_rows_view(
    w: KernelWeight, strides: ExpertStrides, num_experts: int
) -> KernelWeight | None:
    """The experts stacked at ``strides`` after the first expert's view ``w`` as one weight of
    ``num_experts * w.n`` rows (their order), or ``None`` when its rows cannot be read so: a
    global scale per expert, blocks of rows crossing experts (``w.n`` not a multiple of
    ``group_n``), or tensors whose storage does not hold the experts as consecutive rows."""
    if strides.global_scale or w.n % w.group_n:
        return None
    if not all(
        _holds_experts(t, num_experts) for t in (w.data, w.scales, w.zeros) if t is not None
    ):
        return None
    return replace(
        w,
        n=num_experts * w.n,
        data=_experts_rows(w.data, num_experts),
        scales=_experts_rows(w.scales, num_experts),
        zeros=None if w.zeros is None else _experts_rows(w.zeros, num_experts),
    )


def _experts_rows(t: Tensor, num_experts: int) -> Tensor:
    """``t`` (expert 0's rows) extended over the ``num_experts`` experts stored after it."""
    return t.as_strided((num_experts * t.shape[0], *t.shape[1:]), t.stride(), t.storage_offset())


def _holds_experts(t: Tensor, num_experts: int) -> bool:
    """Whether ``t`` (expert 0's rows) is contiguous and its storage holds ``num_experts``
    experts of its size one after another."""
    end = (t.storage_offset() + num_experts * t.numel()) * t.element_size()
    return t.is_contiguous() and t.untyped_storage().nbytes() >= end


class DecodedExperts:
    """``out[r] = x[r] @ W[ids[r]].T + bias[ids[r]]`` for bf16 rows: the experts' stacked rows
    ``rows_view`` decoded to bf16 in one prepared launch, then one ``torch._grouped_mm`` over
    the rows sorted by expert. No host sync. ``on_sorted`` takes rows already sorted (a block's
    two projections sort once)."""

    def __init__(self, rows_view: KernelWeight, num_experts: int, dtype: torch.dtype) -> None:
        from qlens.kernels.dequant import PreparedDequantize  # Triton: once a call is prepared

        self.decode = PreparedDequantize(rows_view, dtype)
        self.shape = (num_experts, rows_view.n // num_experts, rows_view.k)
        self.num_experts = num_experts

    def __call__(
        self, x: Float[Tensor, "rows k"], bias: Tensor | None, ids: Integer[Tensor, " rows"]
    ) -> Float[Tensor, "rows n"]:
        sorted_ids, order, starts = sort_by_expert(ids, self.num_experts)
        product = self.on_sorted(x[order], starts[1:], bias, sorted_ids)
        return torch.empty_like(product).index_copy_(0, order, product)

    def on_sorted(
        self,
        xs: Float[Tensor, "rows k"],
        ends: Integer[Tensor, " experts"],
        bias: Tensor | None,
        sorted_ids: Integer[Tensor, " rows"],
    ) -> Float[Tensor, "rows n"]:
        """The product of rows ``xs`` sorted by expert (``sort_by_expert``), in that order."""
        weights = self.decode().view(self.shape)
        product = torch._grouped_mm(xs, weights.transpose(1, 2), offs=ends)
        if bias is not None:
            product += bias[sorted_ids.long()]
        return product
