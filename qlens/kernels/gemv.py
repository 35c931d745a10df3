"""Weight-only GEMV for a few rows: the weight streams once, decoded in registers.

Packed 4-bit weights whose rows are whole int32 words take ``packed_gemv.packed_gemv_kernel``
(``LinearConfig(words=False)`` turns it off, for comparisons; see ``word_view``): all rows of ``x`` per
weight tile, 16-byte word loads, integer decodes, FMAs for one row and tensor-core dots
beyond (faster than the byte-wise kernel on the H200: ``docs/benchmarks.md``, "Launch
tables"). Other weights take the byte-wise kernel here
(no tensor cores, no shared memory: one program per (N tile, row, K split), so small M re-reads
the strip from L2, not memory, and the product is reduced along K once at the end).
"""

from collections.abc import Callable
from dataclasses import replace
from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.code_order import permute_codes, regrouped_strides
from qlens.kernels.configs import GEMV_MAX_M, LinearConfig, require_tile_sizes
from qlens.kernels.decode import byte_tile_codes, decode_byte_tile, decode_packed_halves
from qlens.kernels.fast_launch import FastLaunch, PreparedLaunch
from qlens.kernels.launch import dot_kernel_args, kernel_args, kernel_constants
from qlens.kernels.layout_view import FP8_BLOCK
from qlens.kernels.numerics import fp8_rounded_row
from qlens.kernels.packed_gemv import packed_gemv_kernel
from qlens.kernels.packed_words import ExpertRows, ExpertStrides, word_view
from qlens.kernels.runtime import capturing_cuda_graph, interpreting
from qlens.kernels.splits import PreparedSplitLaunch, store_tile
from qlens.kernels.weight_only import PreparedWeightOnly
from qlens.kernels.weights import KernelWeight
from qlens.quant.codecs.checks import ceil_div

PACKED_GEMV = FastLaunch(packed_gemv_kernel)


@triton.jit
@no_type_check
def _byte_row(x_row, k0, K, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
              ROUND_X: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``x[k0:k0 + BLOCK_K]`` as float32 ``[1, BLOCK_K]`` (zero past K), rounded to per-token
    FP8 as W8A8 reads it (``ROUND_X``)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + offs_k, mask=(offs_k < K) | EVEN_K, other=0.0).to(tl.float32)
    if ROUND_X:
        x = fp8_rounded_row(x, BLOCK_K, GROUP_K, INTERPRET)
    return x[None, :]


@triton.jit
@no_type_check
def byte_k_range(
    x_row, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, first_row, k_begin, k_end, N, K,
    stride_d, stride_s,
    FAMILY: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SHARED_SCALES: tl.constexpr, LOOP_STAGES: tl.constexpr, ROUND_X: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """float32 ``[BLOCK_N]``: ``sum_k W[n, k] * x[k]`` over ``[k_begin, k_end)`` for the row
    ``x_row`` of a one-byte-per-element weight's rows ``offs_n``. ``SHARED_SCALES``: the rows
    share the scales of ``first_row`` (a block FP8 tile inside one block of rows), which then
    multiply ``x`` once a K step instead of every weight."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        if SHARED_SCALES:
            w, s = byte_tile_codes(
                data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, first_row, k0, N, K,
                stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS,
                GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
            )  # fmt: skip
            acc += w * (_byte_row(x_row, k0, K, BLOCK_K, GROUP_K, EVEN_K, ROUND_X, INTERPRET) * s)
        else:
            w = decode_byte_tile(
                data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
                FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K,
                EVEN_K,
            )  # fmt: skip
            acc += w * _byte_row(x_row, k0, K, BLOCK_K, GROUP_K, EVEN_K, ROUND_X, INTERPRET)
    return tl.sum(acc, axis=1)


@triton.jit
@no_type_check
def _gemv_kernel(
    x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_xm, stride_d, stride_s, stride_om, stride_split,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, LOOP_STAGES: tl.constexpr, ROUND_X: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """``ROUND_X`` (byte-wise weights): each ``GROUP_K`` of ``x`` is read as W8A8 reads it,
    rounded to per-token FP8 (``fp8_rounded_row``). Byte-wise weights whose scale groups span
    the tile's rows (block FP8: 128 rows) multiply the scales into ``x`` once a K step instead
    of into every weight."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_row = tl.program_id(0) * BLOCK_N + tl.arange(0, 1)
    row = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    x_row = x_ptr + row * stride_xm
    if PACKED:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=LOOP_STAGES):
            even, odd = decode_packed_halves(
                data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
                FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K,
                EVEN_K,
            )  # fmt: skip
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs_k, mask=(offs_k < K) | EVEN_K, other=0.0).to(tl.float32)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
            acc += even * x_even[None, :] + odd * x_odd[None, :]
        total = tl.sum(acc, axis=1)
    else:
        total = byte_k_range(
            x_row, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, first_row, k_begin, k_end,
            N, K, stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K, GROUP_N % BLOCK_N == 0, LOOP_STAGES,
            ROUND_X, INTERPRET,
        )  # fmt: skip
    store_tile(total[None, :], out_ptr, partial_ptr, bias_ptr, row + tl.arange(0, 1), offs_n, M,
               N, stride_om, stride_split, pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip


_GEMV = FastLaunch(_gemv_kernel)


# Up to this many rows the packed GEMV multiplies in FMAs; more rows go to tensor-core dots,
# whose cost does not grow with the rows (an FMA product for 2-4 rows ran far slower than bf16:
# benchmarks/results/archive/gemv_registers_h200.md).
FMA_MAX_ROWS = 1
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _packed_block_m(m: int, cfg: LinearConfig, *, experts: bool) -> int:
    """Rows of ``x`` per program of the packed GEMV: one in FMAs (a single row, or one expert
    row each), at least 16 on tensor cores."""
    if experts or m <= FMA_MAX_ROWS:
        return 1
    return max(16, cfg.block_m)


class PackedGemv(PreparedSplitLaunch):
    """The word-wise GEMV of one weight for ``m`` rows of one dtype, prepared once: grid,
    strides, constants and the weight's tensors are fixed, so a call allocates the output and
    launches (plus the split reduction when K is split).

    One row is read by FMAs as the caller holds it, so an eager call is one launch (in CUDA
    graphs too, the row as it is beats it regrouped by code position since the quad tiles:
    ``benchmarks/results/archive/x_as_is_h100.md``). Rows on tensor cores are read as
    ``cfg.x_as_is`` says: as they are, split by code position in the kernel's registers (one
    launch: what host-bound eager calls want), or regrouped by a copy before the launch (less
    GPU time: what CUDA graphs want); by default as they are, but regrouped while a CUDA graph
    captures and on the first call (which compiles that launch before any capture needs it).

    ``experts``: row ``i`` multiplies expert ``ids[i]`` of experts stacked at these strides
    (the ids come with each call)."""

    def __init__(
        self,
        w: KernelWeight,
        words: Tensor,
        m: int,
        dtype: torch.dtype,
        has_bias: bool,
        cfg: LinearConfig,
        experts: ExpertStrides | None = None,
        out_shape: tuple[int, ...] | None = None,
    ) -> None:
        block_m = _packed_block_m(m, cfg, experts=experts is not None)
        use_dot = block_m > 1  # FMAs serve one row a program
        if use_dot:
            require_tile_sizes(block_n=cfg.block_n)  # tensor-core dots need 16 columns or more
        split = 1 if experts is not None else cfg.split_k
        self.m, self.k, self.n = m, w.k, w.n
        grid = (ceil_div(w.n, cfg.block_n), ceil_div(m, block_m), split)
        # The launches prepared: on regrouped rows (tensor cores, unless x is always read as
        # it is), and on rows as they are (unless always regrouped).
        regroups = use_dot and cfg.x_as_is is not True
        as_is = not (regroups and cfg.x_as_is is False)
        kinds = [*([True] if regroups else []), *([False] if as_is else [])]

        def sums(regrouped: bool) -> bool:
            """Whether the launch sums its K splits itself (tensor-core rows only): by default
            the one on rows as they are (eager calls' one launch), not the regrouped one."""
            wanted = not regrouped if cfg.split_sum is None else cfg.split_sum
            return use_dot and split > 1 and wanted

        # x, then bias, out, partials, expert ids and tile counters where the launch reads them
        slots = self._prepare_outputs(
            m, w.n, dtype, has_bias, split, out_shape, words,
            summed_tiles=grid[0] * grid[1] if any(map(sums, kinds)) else 0,
            reduced=not all(map(sums, kinds)),
        )  # fmt: skip
        slots += [8] if experts is not None else []
        scales, zeros, global_scale = (dot_kernel_args if use_dot else kernel_args)(w)[1:]
        slot = words  # placeholder of a per-call tensor; unused pointers point at the words
        interpret = interpreting()

        def prepare(regrouped: bool) -> PreparedLaunch:
            stride_xm, stride_xj = regrouped_strides(w.k) if regrouped else (w.k, 1)
            args = (
                slot, words, scales, zeros, global_scale, slot, slot, slot, slot, slot,
                m, w.n, w.k, stride_xm, stride_xj, words.stride(0), scales.stride(0), w.n,
                m * w.n if split > 1 else 0,
                *((0, 0, 0) if experts is None else (experts.data, experts.scales,
                                                     experts.global_scale)),
            )  # fmt: skip
            return PACKED_GEMV.prepare(
                grid, args, [*slots, *([9] if sums(regrouped) else [])],
                self.device, FAMILY=w.family, GROUP_K=w.group_k, SCALE_E8M0=w.scale_e8m0,
                HAS_ZEROS=w.zeros is not None, GLOBAL_DIVIDE=w.global_divide,
                HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                MASK_N=w.n % cfg.block_n != 0, SPLIT_K=split, SPLIT_SUM=sums(regrouped),
                USE_DOT=use_dot, X_AS_IS=not regrouped, X_DTYPE=_TL_DTYPES[dtype],
                USE_ASM=not interpret,
                EXPERTS=experts is not None, INTERPRET=interpret, LOOP_STAGES=cfg.num_stages,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip

        # Rows on tensor cores: the launch on regrouped rows, when any call takes it.
        self.regrouped = prepare(regrouped=True) if regroups else None
        self.regrouped_sums = sums(True)
        # The launch on rows as they are, when any call takes it (else the regrouped one).
        launch = prepare(regrouped=False) if as_is else self.regrouped
        assert launch is not None  # one of the two is always prepared
        self.launch, self.sums = launch, sums(not as_is)
        self._by_capture = use_dot and cfg.x_as_is is None  # regrouped while graphs capture
        self._regrouped_ran = False

    def __call__(
        self, x: Float[Tensor, "*rows k"], bias: Tensor | None, ids: Tensor | None = None
    ) -> Float[Tensor, "*rows n"]:
        """``x @ W.T + bias`` (``x``: the prepared rows, in the leading shape the output was
        prepared with, and dtype; expert ids as int32)."""
        if not x.is_contiguous():
            x = x.contiguous()
        regrouped = self.regrouped
        if regrouped is not None and (
            not self._by_capture or not self._regrouped_ran or capturing_cuda_graph(self.device)
        ):
            self._regrouped_ran = True
            rows = permute_codes(x.reshape(self.m, self.k))
            return self.run(rows, bias, ids, regrouped, self.regrouped_sums)
        return self.run(x, bias, ids)


def fp8_rounding_refusal(w: KernelWeight, cfg: LinearConfig) -> str | None:
    """Why the byte-wise GEMV cannot read rows rounded to FP8 against ``w`` with ``cfg``'s
    tile (``ROUND_X``: block FP8 weights, ``block_k`` a multiple of the K block), or None."""
    if w.family != FP8_BLOCK or cfg.block_k % w.group_k:
        return (
            f"FP8-rounded rows need a block FP8 weight and block_k a multiple of its K block "
            f"({w.group_k}); got {w.name} and block_k {cfg.block_k}"
        )
    return None


class ByteGemv(PreparedSplitLaunch):
    """The byte-wise GEMV of one weight for ``m`` rows (contiguous), prepared once like
    :class:`PackedGemv`. ``round_x``: the rows are read rounded to per-token FP8 in the weight's
    K blocks, as W8A8 reads them (block FP8 weights, ``block_k`` a multiple of the K block)."""

    def __init__(
        self,
        w: KernelWeight,
        m: int,
        dtype: torch.dtype,
        has_bias: bool,
        cfg: LinearConfig,
        out_shape: tuple[int, ...] | None = None,
        round_x: bool = False,
    ) -> None:
        refusal = fp8_rounding_refusal(w, cfg) if round_x else None
        if refusal is not None:
            raise ValueError(refusal)
        split = cfg.split_k
        data, scales, zeros, global_scale = kernel_args(w)
        slots = self._prepare_outputs(m, w.n, dtype, has_bias, split, out_shape, data)
        device = self.device
        slot = data  # placeholder of a per-call tensor; unused pointers point at the data
        args = (
            slot, data, scales, zeros, global_scale, slot, slot, slot,
            m, w.n, w.k, w.k, w.data.stride(0), w.scales.stride(0), w.n,
            m * w.n if split > 1 else 0,
        )  # fmt: skip
        self.launch = _GEMV.prepare(
            (ceil_div(w.n, cfg.block_n), m, split), args, slots, device,
            **kernel_constants(w), HAS_BIAS=has_bias,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=w.k % cfg.block_k == 0,
            SPLIT_K=split, LOOP_STAGES=cfg.num_stages, ROUND_X=round_x, INTERPRET=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


GemvCall = Callable[[Tensor, Tensor | None], Tensor]
# Prepared launches kept per launch view (one per row count, dtype, bias and launch seen);
# beyond this the view's table starts afresh.
_MAX_KEPT_CALLS = 512


def prepared_gemv(
    w: KernelWeight,
    m: int,
    dtype: torch.dtype,
    has_bias: bool,
    cfg: LinearConfig,
    out_shape: tuple[int, ...] | None = None,
    round_x: bool = False,
) -> GemvCall:
    """:func:`prepare_gemv`, kept on the launch view ``w`` (views are kept on their payloads)."""
    calls = w.__dict__.setdefault("_qlens_gemv_calls", {})
    key = (m, dtype, has_bias, cfg, out_shape, round_x)
    call = calls.get(key)
    if call is None:
        if len(calls) >= _MAX_KEPT_CALLS:
            calls.clear()
        call = calls[key] = prepare_gemv(w, m, dtype, has_bias, cfg, out_shape, round_x)
    return call


def prepare_gemv(
    w: KernelWeight,
    m: int,
    dtype: torch.dtype,
    has_bias: bool,
    cfg: LinearConfig,
    out_shape: tuple[int, ...] | None = None,
    round_x: bool = False,
) -> GemvCall:
    """The ``"gemv"`` path's launch for ``m`` rows of ``dtype`` against ``w``, prepared once:
    packed 4-bit weights in whole words take the packed kernel at any row count (FMAs up to
    ``FMA_MAX_ROWS`` rows, tensor cores beyond); other weights take the byte-wise GEMV up to
    ``GEMV_MAX_M`` rows and the split-K kernel (same tiles) beyond. The call takes contiguous
    ``x`` of ``m`` rows in any leading shape and returns ``out_shape`` (default ``[m, n]``);
    ``round_x``: see :class:`ByteGemv` (one row only)."""
    if round_x:
        if m != 1:
            raise ValueError(f"FP8-rounded rows are read by the one-row GEMV only, got {m} rows")
        return ByteGemv(w, m, dtype, has_bias, cfg, out_shape, round_x=True)
    words = word_view(w) if cfg.words else None
    if words is not None:
        return PackedGemv(w, words, m, dtype, has_bias, cfg, out_shape=out_shape)
    if m > GEMV_MAX_M:  # the byte-wise GEMV re-reads the weight per row
        splitk = replace(cfg, path="splitk")
        return PreparedWeightOnly(w, m, dtype, has_bias, splitk, out_shape or (m, w.n))
    return ByteGemv(w, m, dtype, has_bias, cfg, out_shape)


def experts_gemv(
    x: Float[Tensor, "m k"],
    w: KernelWeight,
    experts: ExpertRows,
    bias: Float[Tensor, "e n"] | None,
    cfg: LinearConfig,
) -> Float[Tensor, "m n"]:
    """``out[m] = x[m] @ W[ids[m]].T + bias[ids[m]]`` in one launch of the word-wise GEMV.

    ``w`` describes the first expert (``w.n`` rows); the others follow at ``experts``' strides.
    ``cfg``'s K split is ignored: each program streams one expert's strip for one row.
    """
    words = word_view(w)
    if words is None:
        raise ValueError(
            f"the one-launch experts GEMV needs packed 4-bit rows of whole int32 words, got "
            f"{w.name} with {w.data.shape[-1]} bytes a row; run experts one by one instead"
        )
    call = PackedGemv(w, words, x.shape[0], x.dtype, bias is not None, cfg, experts)
    return call(x, bias, experts.ids)


def gemv_linear(
    x: Float[Tensor, "m k"],
    w: KernelWeight,
    bias: Float[Tensor, " n"] | None,
    cfg: LinearConfig,
    round_x: bool = False,
) -> Float[Tensor, "m n"]:
    """``x @ W.T + bias`` for a few rows ``x``, ``W`` decoded in-kernel, on the launch
    :func:`prepare_gemv` prepares (once per view, rows, dtype, bias, ``cfg`` and ``round_x``)."""
    return prepared_gemv(w, x.shape[0], x.dtype, bias is not None, cfg, round_x=round_x)(x, bias)
