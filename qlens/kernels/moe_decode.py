"""A few tokens' routed experts in two launches: gate|up with the activation, then down with
the routes' weighted sum. Packed 4-bit experts in whole int32 words (int4, MXFP4, NVFP4) read
as the word-wise GEMV reads them, one-byte experts (block FP8, MXFP8, int8) as the byte-wise
GEMV does.

The unfused decode of a MoE block runs a dozen operations after the router: clamp and mask the
ids, copy each token once per route, the gate|up GEMV, split, activation, product, the down
GEMV, the weighted sum and casts. At decode each costs more host time than GPU time. Here the
first launch reads each route's token row and expert id itself (clamped into range), computes
the gate and up rows of its expert and writes ``act(gate) * up``; the second, one program per
(token, output tile), runs the down product of each of the token's routes and sums them with
their routing weights (a skipped route, id outside ``[0, experts)``, weighs zero).

Every rounding of the unfused path is kept: the projections' outputs and the activation's
steps are rounded to the activations' dtype as the torch ops round them, and the weighted sum
accumulates in float32 and is rounded once, as the batched product does.
"""

from __future__ import annotations

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.configs import LinearConfig, sm_count
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.gate_rule import ACTIVATIONS, GateRule
from qlens.kernels.gemv import byte_k_range
from qlens.kernels.launch import kernel_args, kernel_constants
from qlens.kernels.numerics import cast_out
from qlens.kernels.packed_gemv import quads_k_range
from qlens.kernels.packed_words import ExpertStrides
from qlens.kernels.runtime import interpreting
from qlens.kernels.weights import KernelWeight
from qlens.quant.codecs.checks import ceil_div

MIN_BLOCK_N = 16  # the down launch narrows its tiles to this to fill the GPU


@triton.jit
@no_type_check
def _round(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` as a torch op on ``DTYPE`` tensors rounds its result."""
    return cast_out(x, DTYPE, INTERPRET).to(tl.float32)


@triton.jit
@no_type_check
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr,
              INTERPRET: tl.constexpr):  # fmt: skip
    """``ExpertGate.apply`` on rounded gate and up values, each torch op's rounding kept."""
    if ACTIVATION == 0:  # silu(gate) * up
        act = _round(gate / (1.0 + tl.exp(-gate)), DTYPE, INTERPRET)
        return _round(act * up, DTYPE, INTERPRET)
    else:  # (clamp(up) + 1) * (g * sigmoid(g * alpha)), g = clamp(gate, max=limit)
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        shifted = _round(u + 1.0, DTYPE, INTERPRET)
        scaled = _round(g * alpha, DTYPE, INTERPRET)
        sig = _round(1.0 / (1.0 + tl.exp(-scaled)), DTYPE, INTERPRET)
        glu = _round(g * sig, DTYPE, INTERPRET)
        return _round(shifted * glu, DTYPE, INTERPRET)


@triton.jit
@no_type_check
def _row_product(
    x_ptr, row, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, N, K, stride_d, stride_s,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr, LOOP_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """float32 ``[BLOCK_N]``: rows ``offs_n`` of a weight times row ``row`` of ``x`` (``[.., K]``,
    contiguous), over all of K: the word-wise GEMV's tile for packed 4-bit words, the byte-wise
    one for one-byte weights (each row its own scales)."""
    if PACKED:
        return quads_k_range(
            x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, row + tl.arange(0, 1), offs_n, 0,
            K - K % BLOCK_K, K, N, K, K, stride_d, stride_s, FAMILY, GROUP_K, SCALE_E8M0,
            HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, MASK_N, USE_ASM, LOOP_STAGES,
        )  # fmt: skip
    else:
        return byte_k_range(
            x_ptr + row * K, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, offs_n, 0, K, N,
            K, stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K, False, LOOP_STAGES, False, INTERPRET,
        )  # fmt: skip


@triton.jit
@no_type_check
def _gate_up_kernel(
    x_ptr, ids_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, h_ptr,
    inner, K, num_experts, alpha, limit, stride_w, stride_s, stride_we, stride_se, stride_ge,
    TOP_K: tl.constexpr, INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr, LOOP_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` columns of ``h[route] = act(gate) * up`` for route
    ``program_id(1)``: token ``route // TOP_K`` through expert ``ids[route]`` (clamped)."""
    route = tl.program_id(1)
    expert = tl.load(ids_ptr + route).to(tl.int64)
    expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1)
    words_ptr += expert * stride_we
    scale_ptr += expert * stride_se
    zero_ptr += expert * stride_se
    global_ptr += expert * stride_ge
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INTERLEAVED:
        gate_rows, up_rows = offs_n * 2, offs_n * 2 + 1
    else:
        gate_rows, up_rows = offs_n, offs_n + inner
    token = route // TOP_K
    rows = 2 * inner
    gate = _row_product(
        x_ptr, token, words_ptr, scale_ptr, zero_ptr, global_ptr, gate_rows, rows, K, stride_w,
        stride_s, FAMILY, PACKED, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE,
        BLOCK_N, BLOCK_K, MASK_N, EVEN_K, USE_ASM, LOOP_STAGES, INTERPRET,
    )  # fmt: skip
    up = _row_product(
        x_ptr, token, words_ptr, scale_ptr, zero_ptr, global_ptr, up_rows, rows, K, stride_w,
        stride_s, FAMILY, PACKED, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE,
        BLOCK_N, BLOCK_K, MASK_N, EVEN_K, USE_ASM, LOOP_STAGES, INTERPRET,
    )  # fmt: skip
    n_ok = offs_n < inner
    if HAS_BIAS:
        bias_row = bias_ptr + expert * rows
        gate += tl.load(bias_row + gate_rows, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_row + up_rows, mask=n_ok, other=0.0).to(tl.float32)
    gate = _round(gate, h_ptr.dtype.element_ty, INTERPRET)
    up = _round(up, h_ptr.dtype.element_ty, INTERPRET)
    h = _activate(gate, up, alpha, limit, ACTIVATION, h_ptr.dtype.element_ty, INTERPRET)
    tl.store(h_ptr + route * inner + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
@no_type_check
def _down_sum_kernel(
    h_ptr, ids_ptr, weights_ptr, words_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, out_ptr,
    N, K, num_experts, stride_w, stride_s, stride_we, stride_se, stride_ge,
    TOP_K: tl.constexpr, FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr,
    GLOBAL_DIVIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MASK_N: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
    LOOP_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` columns of token ``program_id(1)``'s output, the sum over its
    routes of ``weight * down(h[route])``, each product rounded as the down GEMV's output."""
    token = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):
        route = token * TOP_K + j
        raw = tl.load(ids_ptr + route).to(tl.int64)
        expert = tl.minimum(tl.maximum(raw, 0), num_experts - 1)
        weight = tl.load(weights_ptr + route).to(tl.float32)
        weight = _round(tl.where((raw >= 0) & (raw < num_experts), weight, 0.0),
                        out_ptr.dtype.element_ty, INTERPRET)  # fmt: skip
        y = _row_product(
            h_ptr, route, words_ptr + expert * stride_we,
            scale_ptr + expert * stride_se, zero_ptr + expert * stride_se,
            global_ptr + expert * stride_ge, offs_n, N, K, stride_w, stride_s, FAMILY, PACKED,
            GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, MASK_N,
            EVEN_K, USE_ASM, LOOP_STAGES, INTERPRET,
        )  # fmt: skip
        if HAS_BIAS:
            y += tl.load(bias_ptr + expert * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        total += weight * _round(y, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(
        out_ptr + token * N + offs_n,
        cast_out(total, out_ptr.dtype.element_ty, INTERPRET),
        mask=n_ok,
    )


_GATE_UP = FastLaunch(_gate_up_kernel)
_DOWN_SUM = FastLaunch(_down_sum_kernel)


class FusedMoeDecode:
    """Routed experts for ``tokens`` tokens of ``top_k`` routes, prepared once:
    ``call(x [tokens, hidden], ids [tokens, top_k], weights [tokens, top_k], gate_up_bias,
    down_bias)`` is two launches (contiguous inputs; ids of any integer dtype, weights of any
    float dtype, biases ``[experts, 2 * inner]`` and ``[experts, hidden]`` where prepared).

    ``first`` and ``down``: each projection's first expert view, the data the kernels read (int32
    words of packed 4-bit codes, or bytes), its experts' strides and its launch config (the
    GEMV's of one expert)."""

    def __init__(
        self,
        first: tuple[KernelWeight, Tensor, ExpertStrides, LinearConfig],
        down: tuple[KernelWeight, Tensor, ExpertStrides, LinearConfig],
        num_experts: int,
        rule: GateRule,
        tokens: int,
        top_k: int,
        dtype: torch.dtype,
        biases: tuple[bool, bool],
    ) -> None:
        (w1, data1, strides1, cfg1), (w2, data2, strides2, cfg2) = first, down
        inner, hidden = w2.k, w2.n
        if w1.n != 2 * inner or w1.k != hidden:
            raise ValueError(
                f"gate_up experts [{w1.n}, {w1.k}] do not match down experts [{w2.n}, {w2.k}]: "
                f"expected gate_up [2 * {inner}, {hidden}]"
            )
        self.tokens, self.top_k, self.inner, self.hidden = tokens, top_k, inner, hidden
        self.dtype, self.device = dtype, data1.device
        interpret = interpreting()
        slot = data1  # placeholder of a per-call tensor; unused pointers point at the data
        first_bias, down_bias = biases
        self.gate_up = _GATE_UP.prepare(
            (ceil_div(inner, cfg1.block_n), tokens * top_k),
            (
                slot, slot, data1, *kernel_args(w1)[1:], slot, slot, inner, hidden, num_experts,
                float(rule.alpha), float(rule.limit), data1.stride(0), w1.scales.stride(0),
                strides1.data, strides1.scales, strides1.global_scale,
            ),
            [0, 1, *([6] if first_bias else []), 7],
            self.device,
            TOP_K=top_k, INTERLEAVED=rule.interleaved, ACTIVATION=ACTIVATIONS[rule.activation],
            **kernel_constants(w1), EVEN_K=w1.k % cfg1.block_k == 0, HAS_BIAS=first_bias,
            BLOCK_N=cfg1.block_n, BLOCK_K=cfg1.block_k, MASK_N=inner % cfg1.block_n != 0,
            USE_ASM=not interpret,
            LOOP_STAGES=cfg1.num_stages, INTERPRET=interpret, num_warps=cfg1.num_warps,
            num_stages=cfg1.num_stages,
        )  # fmt: skip
        block_n = cfg2.block_n
        sms = sm_count(self.device)
        while block_n > MIN_BLOCK_N and ceil_div(hidden, block_n) * tokens < sms:
            block_n //= 2
        self.down_sum = _DOWN_SUM.prepare(
            (ceil_div(hidden, block_n), tokens),
            (
                slot, slot, slot, data2, *kernel_args(w2)[1:], slot, slot, hidden, inner,
                num_experts, data2.stride(0), w2.scales.stride(0), strides2.data,
                strides2.scales, strides2.global_scale,
            ),
            [0, 1, 2, *([7] if down_bias else []), 8],
            self.device,
            TOP_K=top_k, **kernel_constants(w2), EVEN_K=w2.k % cfg2.block_k == 0,
            HAS_BIAS=down_bias, BLOCK_N=block_n, BLOCK_K=cfg2.block_k,
            MASK_N=hidden % block_n != 0, USE_ASM=not interpret,
            LOOP_STAGES=cfg2.num_stages, INTERPRET=interpret, num_warps=cfg2.num_warps,
            num_stages=cfg2.num_stages,
        )  # fmt: skip

    def __call__(
        self,
        x: Float[Tensor, "tokens hidden"],
        ids: Integer[Tensor, "tokens k"],
        weights: Float[Tensor, "tokens k"],
        gate_up_bias: Float[Tensor, "experts two_i"] | None,
        down_bias: Float[Tensor, "experts hidden"] | None,
    ) -> Float[Tensor, "tokens hidden"]:
        """``sum_k weights[t, k] * down(act(gate_up(x[t]))[ids[t, k]]``, as
        ``route_to_experts`` computes it (inputs contiguous, shapes as prepared)."""
        h = torch.empty(
            (self.tokens * self.top_k, self.inner), dtype=self.dtype, device=self.device
        )
        out = torch.empty((self.tokens, self.hidden), dtype=self.dtype, device=self.device)
        if gate_up_bias is not None:
            self.gate_up(x, ids, gate_up_bias, h)
        else:
            self.gate_up(x, ids, h)
        if down_bias is not None:
            self.down_sum(h, ids, weights, down_bias, out)
        else:
            self.down_sum(h, ids, weights, out)
        return out
