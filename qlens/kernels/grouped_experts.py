"""Routed experts in one grouped launch: every (token, expert) row of every expert at once.

Rows are sorted by expert on the device (``expert_sort.sort_by_expert``: a stable
``torch.sort``, then each expert's first sorted row by ``torch.searchsorted``; on CUDA,
``torch.bincount`` would read the ids' maximum on the host, a sync). Each expert's rows form
``BLOCK_M`` tiles; one program computes one tile's ``BLOCK_N`` output columns. A program finds
its tile's expert from the per-expert row bounds (a cumulative sum of the experts' tile counts,
in registers), gathers its rows of ``x`` by their original positions, decodes its expert's
weight tile, multiplies on tensor cores and writes the rows back where they came from. Packed 4-bit words take the word-wise GEMV's decode
(``packed_gemv.dot_k_range``: int4 with or without zero points, MXFP4, NVFP4 with one global
scale or one per expert); one-byte elements (fp8-block, MXFP8, int8) the weight-only kernel's
(``weight_only.byte_dot_tile``: the tile decoded to float32, scaled per block, then cast to
the activations' dtype for the dot). The grid is sized on the host without reading the ids:
``ceil(rows / BLOCK_M) + experts`` tiles bound the real count, and programs past it return at
once."""

from __future__ import annotations

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.code_order import permute_codes, regrouped_strides
from qlens.kernels.configs import LinearConfig, next_pow2
from qlens.kernels.expert_sort import sort_by_expert
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.gemv import _TL_DTYPES
from qlens.kernels.launch import dot_kernel_args, kernel_constants
from qlens.kernels.packed_gemv import dot_k_range
from qlens.kernels.packed_words import ExpertRows, ExpertStrides, word_view
from qlens.kernels.runtime import interpreting, require_kernel_device
from qlens.kernels.splits import store_tile
from qlens.kernels.weight_only import byte_dot_k_range
from qlens.kernels.weights import KernelWeight
from qlens.quant.codecs.checks import ceil_div


@triton.jit
@no_type_check
def _tile_rows(bounds_ptr, tile, E, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(expert, first, end)`` of M tile ``tile``: its expert and its sorted rows ``[first,
    end)``; the expert is ``E`` or more past the last tile. ``bounds[e]`` is expert ``e``'s first
    sorted row (``bounds[E]``: all rows); experts' tiles follow each other in expert order."""
    e = tl.arange(0, EXPERTS)
    real = e < E
    starts = tl.load(bounds_ptr + e, mask=real, other=0)
    ends = tl.load(bounds_ptr + e + 1, mask=real, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles_through = tl.cumsum(tiles, 0)
    expert = tl.sum((tiles_through <= tile).to(tl.int32), 0)
    this = e == expert
    first_tile = tl.sum(tl.where(this, tiles_through - tiles, 0), 0)
    first = tl.sum(tl.where(this, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    return expert, first, tl.sum(tl.where(this, ends, 0), 0)


@triton.jit
@no_type_check
def _grouped_experts_kernel(
    x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, out_ptr, order_ptr, bounds_ptr,
    M, N, K, E, stride_xm, stride_xj, stride_d, stride_s, stride_om,
    stride_de, stride_se, stride_ge,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MASK_N: tl.constexpr, EXPERTS: tl.constexpr, X_DTYPE: tl.constexpr,
    USE_ASM: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` columns of one tile of ``BLOCK_M`` rows of one expert.

    ``order`` holds the rows sorted by expert (original positions), ``bounds`` each expert's
    first sorted row; the expert's data, scales (and zero points), global scale and bias lie
    ``stride_de``, ``stride_se``, ``stride_ge`` and ``N`` elements after the previous one's.
    ``PACKED``: int32 words of packed 4-bit codes and ``x`` regrouped by code position
    (``permute_codes``); else one byte an element (fp8, int8) and ``x`` as it is.
    """
    # One grid axis (no 65535 limit on the tiles): the column tiles of one row tile run next to
    # each other, so each tile's rows of x are read from memory once.
    column_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0) % column_tiles
    expert, first, end = _tile_rows(bounds_ptr, tl.program_id(0) // column_tiles, E, EXPERTS,
                                    BLOCK_M)  # fmt: skip
    if expert >= E:  # past the last tile
        return
    sorted_rows = first + tl.arange(0, BLOCK_M)
    # Rows past the tile's end read as M: masked off by every load and store below.
    offs_m = tl.load(order_ptr + sorted_rows, mask=sorted_rows < end, other=M).to(tl.int64)
    offset = expert.to(tl.int64)
    data_ptr += offset * stride_de
    scale_ptr += offset * stride_se
    zero_ptr += offset * stride_se
    global_ptr += offset * stride_ge
    bias_ptr += offset * N
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_full = K - K % BLOCK_K
    if PACKED:
        acc = dot_k_range(
            acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, 0, k_full, K,
            M, N, K, stride_xm, stride_xj, stride_d, stride_s, FAMILY, GROUP_K, SCALE_E8M0,
            HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, MASK_N, USE_ASM, False, X_DTYPE,
            INTERPRET,
        )  # fmt: skip
    else:
        acc = byte_dot_k_range(
            acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, 0, k_full, K,
            M, N, K, stride_xm, stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0,
            HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, INTERPRET,
        )  # fmt: skip
    store_tile(acc, out_ptr, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, 0, 0, HAS_BIAS,
               1, INTERPRET)  # fmt: skip


GROUPED_EXPERTS = FastLaunch(_grouped_experts_kernel)


def grouped_config(rows: int, experts: int, n: int, *, packed: bool = True) -> LinearConfig:
    """Tiles of the grouped launch: ``BLOCK_M`` near the mean rows per expert (16 to 64, so
    few rows are padding), 64 columns, K steps of 128 elements (``packed`` 4-bit words) or 64
    (one byte an element) pipelined 3 deep on 8 warps. Chosen by registers, not yet by time:
    compiled for sm_90 (Triton 3.9) these launches spill nothing for any family, while
    256-element K steps of packed words at 64 rows spilled 400-750 bytes a thread on 4 warps
    and 100-150 on 8, and 128-element steps of fp8 bytes 344-360 on 8 warps and 1448 on 4
    (``test_grouped_experts_sm90.py``). The interpreter takes at most 64 columns."""
    block_m = min(64, max(16, next_pow2(ceil_div(rows, experts))))
    if interpreting():
        block_n = min(64, max(16, next_pow2(n)))
        return LinearConfig("gemm", block_m, block_n, 128, num_warps=4, num_stages=1)
    return LinearConfig("gemm", block_m, 64, 128 if packed else 64, num_warps=8, num_stages=3)


def check_grouped_inputs(x: Tensor, w: KernelWeight, num_experts: int, bias: Tensor | None) -> None:
    """Raise unless the kernels run on ``x``'s device and ``x`` and ``bias`` fit the experts
    (the activations' dtype is checked by :class:`GroupedExperts`)."""
    require_kernel_device(x.device)
    if w.data.device != x.device:
        raise ValueError(
            f"input is on {x.device} but the quantized experts are on {w.data.device}; move one "
            "of them (payload.to(device))"
        )
    if bias is not None and (bias.shape != (num_experts, w.n) or bias.device != x.device):
        raise ValueError(
            f"bias must have shape [{num_experts}, {w.n}] on {x.device}, got "
            f"{list(bias.shape)} on {bias.device}"
        )


def grouped_experts_linear(
    x: Float[Tensor, "rows k"],
    w: KernelWeight,
    experts: ExpertRows,
    num_experts: int,
    bias: Float[Tensor, "e n"] | None,
    cfg: LinearConfig | None = None,
) -> Float[Tensor, "rows n"]:
    """``out[r] = x[r] @ W[ids[r]].T + bias[ids[r]]`` for every row in one launch.

    ``w`` is the first expert's view: packed 4-bit rows of whole int32 words, or one byte an
    element (fp8-block, MXFP8, int8); ``experts`` holds the rows' ids (in ``[0,
    num_experts)``: rows of other ids are left unwritten) and the strides between experts;
    ``x`` and ``bias`` are contiguous. ``cfg`` overrides ``grouped_config``.
    """
    check_grouped_inputs(x, w, num_experts, bias)
    call = GroupedExperts(
        w, experts, num_experts, x.shape[0], x.dtype, bias is not None, cfg, ids_in_range=False
    )
    return call(x, bias, experts.ids)


class GroupedExperts:
    """The grouped launch of experts stacked at ``strides`` after the first expert's view
    ``w``, for ``rows`` rows of ``dtype``, built once (``ExpertsPlan`` keeps one per row count)
    with its launch prepared: a call sorts the rows by expert (or takes them sorted,
    :meth:`on_order`), regroups ``x`` (packed words), allocates the output and launches. The
    inputs are not checked (:func:`grouped_experts_linear` checks them). ``ids_in_range``: see
    :func:`~qlens.kernels.expert_sort.sort_by_expert`."""

    def __init__(
        self,
        w: KernelWeight,
        strides: ExpertStrides,
        num_experts: int,
        rows: int,
        dtype: torch.dtype,
        has_bias: bool,
        cfg: LinearConfig | None = None,
        ids_in_range: bool = True,
    ) -> None:
        words = word_view(w) if w.packed else None
        if w.packed and words is None:
            raise ValueError(
                f"the grouped experts GEMM needs packed 4-bit rows of whole int32 words, got "
                f"{w.name} with {w.data.shape[-1]} bytes a row; run experts one by one instead"
            )
        if dtype not in _TL_DTYPES:
            raise ValueError(
                f"the grouped experts GEMM takes {[str(d) for d in _TL_DTYPES]} activations, "
                f"got {dtype}; cast the input first"
            )
        cfg = cfg if cfg is not None else grouped_config(rows, num_experts, w.n, packed=w.packed)
        data, scales, zeros, global_scale = dot_kernel_args(w)
        if words is not None:
            data, (stride_xm, stride_xj) = words, regrouped_strides(w.k)
        else:
            stride_xm, stride_xj = w.k, 1
        self.packed, self.num_experts = words is not None, num_experts
        self.ids_in_range = ids_in_range
        self.out_shape, self.dtype, self.device = (rows, w.n), dtype, data.device
        max_tiles = ceil_div(rows, cfg.block_m) + min(num_experts, rows)
        slot = data  # placeholder of a per-call tensor; an unused bias pointer points at it
        args = (
            slot, data, scales, zeros, global_scale, slot, slot, slot, slot,
            rows, w.n, w.k, num_experts, stride_xm, stride_xj, data.stride(0), scales.stride(0),
            w.n, strides.data, strides.scales, strides.global_scale,
        )  # fmt: skip
        self.has_bias = has_bias
        # x, then bias where the launch reads it, out, the sorted order and the experts' starts
        slots = [0, *([5] if has_bias else []), 6, 7, 8]
        interpret = interpreting()
        self.launch = GROUPED_EXPERTS.prepare(
            (ceil_div(w.n, cfg.block_n) * max_tiles,), args, slots, self.device,
            **kernel_constants(w), HAS_BIAS=has_bias,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            MASK_N=w.n % cfg.block_n != 0, EXPERTS=next_pow2(num_experts),
            X_DTYPE=_TL_DTYPES[dtype], USE_ASM=not interpret, INTERPRET=interpret,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def __call__(
        self, x: Float[Tensor, "rows k"], bias: Tensor | None, ids: Integer[Tensor, " rows"]
    ) -> Float[Tensor, "rows n"]:
        """``out[r] = x[r] @ W[ids[r]].T + bias[ids[r]]`` (``bias``: contiguous)."""
        _, order, starts = sort_by_expert(ids, self.num_experts, ids_in_range=self.ids_in_range)
        return self.on_order(x, bias, order, starts)

    def on_order(
        self,
        x: Float[Tensor, "rows k"],
        bias: Tensor | None,
        order: Integer[Tensor, " rows"],
        starts: Integer[Tensor, " bounds"],
    ) -> Float[Tensor, "rows n"]:
        """The same for rows whose sorted order and experts' starts ``sort_by_expert`` gave (a
        block's two projections sort once); rows and outputs stay in their own order."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.out_shape[0] == 0:
            return out
        if not x.is_contiguous():
            x = x.contiguous()
        xk = permute_codes(x) if self.packed else x
        if self.has_bias:
            assert bias is not None
            self.launch(xk, bias if bias.is_contiguous() else bias.contiguous(), out, order, starts)
        else:
            self.launch(xk, out, order, starts)
        return out
