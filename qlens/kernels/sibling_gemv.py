"""One launch for the one-row products of sibling weights that read the same row.

Attention's q, k and v projections (and an MLP's gate and up) multiply the same activations by
two or three weights of one format. At one row each is a GEMV whose host cost (a launch, an
output) is what eager decode pays; :class:`SiblingGemv` runs them as one GEMV over the
weights stacked along N, without copying them: each program picks the weight its columns fall
in and shifts that weight's pointers so that the stacked column index addresses it, then runs
the single-weight kernel's program unchanged (``packed_gemv_kernel`` for packed 4-bit words,
``_gemv_kernel`` for byte-wise weights). The output is one ``[..., n0 + n1 (+ n2)]`` tensor
and each sibling's product a view of its columns.

A weight's columns must start on a program's tile and on its scale groups, so every sibling's
``n`` is a multiple of the tile width and of ``group_n``; the siblings share the format, ``k``,
dtypes and strides. :func:`sibling_gemv` says why when they do not (no launch is prepared).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.configs import LinearConfig
from qlens.kernels.dispatch import _weight_config
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.gemv import _TL_DTYPES, _gemv_kernel, fp8_rounding_refusal
from qlens.kernels.launch import kernel_args, kernel_constants
from qlens.kernels.packed_gemv import packed_gemv_kernel
from qlens.kernels.packed_words import word_view
from qlens.kernels.runtime import interpreting
from qlens.kernels.weights import KernelWeight
from qlens.quant.codecs.checks import ceil_div

if TYPE_CHECKING:
    from qlens.kernels.plan import LinearPlan

MAX_SIBLINGS = 3


@triton.jit
@no_type_check
def _sibling_pointers(col, START1: tl.constexpr, START2: tl.constexpr, GROUP_N: tl.constexpr,
                      stride_d, stride_s, d0, s0, z0, g0, b0, d1, s1, z1, g1, b1, d2, s2, z2, g2,
                      b2):  # fmt: skip
    """The pointers of the sibling holding stacked column ``col``, shifted back by the columns
    before it: stacked column ``c`` then addresses that sibling's row ``c - start``."""
    third = col >= START2
    second = (col >= START1) & (col < START2)
    shift = second.to(tl.int32) * START1 + third.to(tl.int32) * START2
    if third:
        d, s, z, g, b = d2, s2, z2, g2, b2
    elif second:
        d, s, z, g, b = d1, s1, z1, g1, b1
    else:
        d, s, z, g, b = d0, s0, z0, g0, b0
    rows = shift // GROUP_N
    return d - shift * stride_d, s - rows * stride_s, z - rows * stride_s, g, b - shift


@triton.jit
@no_type_check
def packed_siblings_gemv_kernel(
    x_ptr, w0, s0, z0, g0, b0, w1, s1, z1, g1, b1, w2, s2, z2, g2, b2, out_ptr,
    N, K, stride_w, stride_s,
    START1: tl.constexpr, START2: tl.constexpr,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_DTYPE: tl.constexpr,
    USE_ASM: tl.constexpr, INTERPRET: tl.constexpr, LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    """``packed_gemv_kernel``'s one-row FMA program over siblings stacked along N (``N`` in
    all; sibling 1 from column ``START1``, sibling 2 from ``START2``, ``N`` when absent)."""
    w, s, z, g, b = _sibling_pointers(
        tl.program_id(0) * BLOCK_N, START1, START2, 1, stride_w, stride_s,
        w0, s0, z0, g0, b0, w1, s1, z1, g1, b1, w2, s2, z2, g2, b2,
    )  # fmt: skip
    packed_gemv_kernel(
        x_ptr, w, s, z, g, b, out_ptr, out_ptr, out_ptr, out_ptr,
        1, N, K, K, 1, stride_w, stride_s, N, 0, 0, 0, 0,
        FAMILY, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, HAS_BIAS,
        1, BLOCK_N, BLOCK_K, False, 1, False, False, True, X_DTYPE, USE_ASM, False, INTERPRET,
        LOOP_STAGES,
    )  # fmt: skip


@triton.jit
@no_type_check
def byte_siblings_gemv_kernel(
    x_ptr, d0, s0, z0, g0, b0, d1, s1, z1, g1, b1, d2, s2, z2, g2, b2, out_ptr,
    N, K, stride_d, stride_s,
    START1: tl.constexpr, START2: tl.constexpr,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr, ROUND_X: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``_gemv_kernel``'s one-row program over siblings stacked along N (as above); ``ROUND_X``:
    the row read rounded to FP8 as W8A8 reads it."""
    d, s, z, g, b = _sibling_pointers(
        tl.program_id(0) * BLOCK_N, START1, START2, GROUP_N, stride_d, stride_s,
        d0, s0, z0, g0, b0, d1, s1, z1, g1, b1, d2, s2, z2, g2, b2,
    )  # fmt: skip
    _gemv_kernel(
        x_ptr, d, s, z, g, b, out_ptr, out_ptr,
        1, N, K, K, stride_d, stride_s, N, 0,
        FAMILY, PACKED, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, HAS_BIAS,
        BLOCK_N, BLOCK_K, EVEN_K, 1, LOOP_STAGES, ROUND_X, INTERPRET,
    )  # fmt: skip


_PACKED_SIBLINGS = FastLaunch(packed_siblings_gemv_kernel)
_BYTE_SIBLINGS = FastLaunch(byte_siblings_gemv_kernel)


class SiblingGemv:
    """``x @ W_i.T (+ b_i)`` for every sibling weight ``W_i`` and one row ``x``, in one launch
    prepared once (grid, strides, constants, the weights' tensors fixed): a call allocates the
    stacked output and launches. Built by :func:`sibling_gemv`, which checks the siblings."""

    def __init__(
        self,
        views: list[KernelWeight],
        words: list[Tensor] | None,
        dtype: torch.dtype,
        has_bias: bool,
        cfg: LinearConfig,
        round_x: bool = False,
    ) -> None:
        first = views[0]
        self.sizes = [w.n for w in views]
        self.n, self.k, self.dtype, self.has_bias = sum(self.sizes), first.k, dtype, has_bias
        self.config = cfg  # the tile, chosen for the stacked [n, k]
        self.device = first.data.device
        starts = [sum(self.sizes[:i]) for i in range(1, len(views))] + [self.n] * 2
        tensors = []
        for i in range(MAX_SIBLINGS):
            j = min(i, len(views) - 1)  # an absent third sibling repeats the last one
            data, scales, zeros, global_scale = kernel_args(views[j])
            if words is not None:
                data = words[j]
            tensors += [data, scales, zeros, global_scale, data]  # the bias: a per-call slot
        slot = tensors[0]
        args = (slot, *tensors, slot, self.n, self.k, tensors[0].stride(0), first.scales.stride(0))
        bias_slots = [5, 10, 15] if has_bias else []
        slots = [0, *bias_slots, 16]
        grid = (ceil_div(self.n, cfg.block_n), 1, 1)
        interpret = interpreting()
        common = dict(
            START1=starts[0], START2=starts[1], HAS_BIAS=has_bias,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LOOP_STAGES=cfg.num_stages,
            INTERPRET=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if words is not None:
            self.launch = _PACKED_SIBLINGS.prepare(
                grid, args, slots, self.device, FAMILY=first.family,
                GROUP_K=first.group_k, SCALE_E8M0=first.scale_e8m0,
                HAS_ZEROS=first.zeros is not None, GLOBAL_DIVIDE=first.global_divide,
                X_DTYPE=_TL_DTYPES[dtype], USE_ASM=not interpret, **common,
            )  # fmt: skip
        else:
            self.launch = _BYTE_SIBLINGS.prepare(
                grid, args, slots, self.device, **kernel_constants(first),
                EVEN_K=first.k % cfg.block_k == 0, ROUND_X=round_x, **common,
            )  # fmt: skip

    def __call__(
        self, x: Float[Tensor, "*one k"], biases: list[Tensor] | None
    ) -> tuple[Tensor, ...]:
        """Each sibling's ``x @ W.T (+ bias)``, views of one output (``x``: one contiguous row
        in any leading shape; ``biases``: one per sibling when prepared with biases)."""
        return torch.split(self.stacked(x, biases), self.sizes, dim=-1)

    def stacked(
        self, x: Float[Tensor, "*one k"], biases: Sequence[Tensor] | None
    ) -> Float[Tensor, "*one n"]:
        """Every sibling's product in one ``[..., n0 + n1 (+ n2)]`` tensor (see ``__call__``)."""
        out = torch.empty((*x.shape[:-1], self.n), dtype=self.dtype, device=self.device)
        if biases is None:
            self.launch(x, out)
        else:
            b = (*biases, biases[-1])
            self.launch(x, b[0], b[1], b[2], out)
        return out


def _layout(w: KernelWeight) -> tuple[object, ...]:
    """What siblings sharing a launch must share: format, ``k``, tensor dtypes, strides, device."""
    return (
        w.family, w.k, w.group_n, w.group_k, w.scale_e8m0, w.global_divide, w.name,
        w.zeros is None, w.global_scale is None, w.data.dtype, w.scales.dtype,
        w.data.stride(), w.scales.stride(), w.data.device,
    )  # fmt: skip


def sibling_gemv(
    views: list[KernelWeight],
    dtype: torch.dtype,
    has_bias: bool,
    device: torch.device,
    round_x: bool = False,
) -> SiblingGemv | str:
    """The one-launch GEMV of the sibling weights ``views`` for one row of ``dtype``, or why
    they cannot share one (a sentence). ``round_x``: the row is read rounded to per-token FP8
    in the weights' K blocks, as W8A8 reads one row (``gemv.ByteGemv``; block FP8 only)."""
    if not 2 <= len(views) <= MAX_SIBLINGS:
        return f"2 to {MAX_SIBLINGS} weights share a launch, got {len(views)}"
    first = views[0]
    for w in views[1:]:
        if _layout(w) != _layout(first):
            return f"{w.name} [{w.n}, {w.k}] is not laid out as {first.name} [{first.n}, {first.k}]"
        if w.zeros is not None and w.zeros.stride() != w.scales.stride():
            return "zero points are not laid out as the scales"
    words = [word_view(w) for w in views]
    packed_words = None if any(t is None for t in words) else [t for t in words if t is not None]
    if packed_words is None and any(t is not None for t in words):
        return "only some of the weights are whole packed words"
    stacked = replace(first, n=sum(w.n for w in views))
    cfg = _weight_config(stacked, 1, device, False)
    if cfg.path != "gemv" or cfg.split_k != 1:
        return f"one row of [{stacked.n}, {stacked.k}] takes the {cfg.path} path, not one GEMV"
    if packed_words is None and first.packed and first.k % 2:
        return "packed rows of odd length"
    refusal = fp8_rounding_refusal(first, cfg) if round_x else None
    if refusal is not None:
        return refusal
    for w in views:
        if w.n % cfg.block_n or w.n % first.group_n:
            return (
                f"a weight of {w.n} rows does not start on a {cfg.block_n}-column tile and a "
                f"{first.group_n}-row scale group"
            )
    return SiblingGemv(views, packed_words, dtype, has_bias, cfg, round_x)


def plans_gemv(
    plans: Sequence[LinearPlan],
    dtype: torch.dtype,
    has_bias: bool,
    device: torch.device,
    round_x: bool = False,
) -> SiblingGemv | str:
    """:func:`sibling_gemv` for the weights of these linear plans, or why they cannot share a
    launch (a sentence; also when a plan is not on the kernel route)."""
    views = [p.view for p in plans]
    if any(p.route != "kernel" for p in plans):
        return "a weight does not take the fused kernels on this device"
    present = [v for v in views if v is not None]
    return sibling_gemv(present, dtype, has_bias, device, round_x)
