"""Weight-only quantized linear (W4A16 / W8A16): the weight is decoded to the activation dtype
inside the K loop and multiplied on tensor cores; small M splits K over programs.

The ``gemm`` path of packed 4-bit weights computes ``W x^T``: the decoded weight is then the
dots' left operand, which Hopper's tensor cores (``wgmma``) read from registers, so the decoded
tile never goes through shared memory (a local sm_90 compile shows the packed bytes and the
activations streamed by ``cp.async`` and no shared-memory store in the K loop). As the right
operand, as on the other paths, each K step stores it there first.
"""

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.configs import LinearConfig
from qlens.kernels.decode import decode_byte_tile, decode_packed_halves
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.launch import kernel_args, kernel_constants, on_device
from qlens.kernels.runtime import interpreting
from qlens.kernels.splits import PreparedSplitLaunch, split_target, store_tile
from qlens.kernels.weights import KernelWeight
from qlens.quant.codecs.checks import ceil_div


@triton.jit
@no_type_check
def _dot_acc(x, w, acc, INTERPRET: tl.constexpr):
    """``acc + x @ w.T`` with ``w`` float32 decoded weights, on tensor cores in ``x``'s dtype."""
    if INTERPRET or x.dtype == tl.float32:
        # The interpreter multiplies bf16 bit patterns, so it computes in float32.
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
@no_type_check
def _dot_left(w, xt, acc, INTERPRET: tl.constexpr):
    """``acc + w @ xt`` with ``w`` float32 decoded weights ``[BN, BK]`` as the left operand."""
    if INTERPRET or xt.dtype == tl.float32:
        return tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w.to(xt.dtype), xt, acc)


@triton.jit
@no_type_check
def byte_dot_tile(
    acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N, K,
    stride_xm, stride_d, stride_s,
    FAMILY: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``acc[m, n] += x[m, k0:k0 + BLOCK_K] @ W[n, k0:k0 + BLOCK_K]`` for a one-byte-per-element
    weight (fp8, int8): the tile decoded to float32, then a tensor-core dot in ``x``'s dtype.
    Rows ``offs_m`` at or past ``M`` read zeros; ``EVEN_K``: the tile lies inside K."""
    w = decode_byte_tile(
        data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
        FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
    )  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask=(offs_m < M)[:, None] & ((offs_k < K)[None, :] | EVEN_K),
        other=0.0,
    )
    return _dot_acc(x, w, acc, INTERPRET)


@triton.jit
@no_type_check
def byte_dot_k_range(
    acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_begin, k_full,
    k_end, M, N, K, stride_xm, stride_d, stride_s,
    FAMILY: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``byte_dot_tile`` over ``[k_begin, k_end)``: whole ``BLOCK_K`` steps up to ``k_full``
    unmasked along K, then the masked rest (the one-byte counterpart of ``dot_k_range``)."""
    for k0 in range(k_begin, k_full, BLOCK_K):
        acc = byte_dot_tile(
            acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N, K,
            stride_xm, stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, True, INTERPRET,
        )  # fmt: skip
    if k_full < k_end:
        acc = byte_dot_tile(
            acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k_full, M, N,
            K, stride_xm, stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS,
            GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, False, INTERPRET,
        )  # fmt: skip
    return acc


@triton.jit
@no_type_check
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` in grouped order: ``GROUP_M`` row tiles sweep the
    N tiles together, so the weight tiles they share stay in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
@no_type_check
def _weight_only_kernel(
    x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_xm, stride_d, stride_s, stride_om, stride_split,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, WEIGHT_LEFT: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    if WEIGHT_LEFT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # the transposed tile, W x^T
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if WEIGHT_LEFT:  # packed 4-bit weights only
            even, odd = decode_packed_halves(
                data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
                FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
            )  # fmt: skip
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(
                x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                mask=m_mask[None, :] & ((offs_k < K)[:, None] | EVEN_K),
                other=0.0,
            )
            w = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
            acc = _dot_left(w, xt, acc, INTERPRET)
        elif PACKED:
            w_even, w_odd = decode_packed_halves(
                data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
                FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
            )  # fmt: skip
            offs_k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            if EVEN_K:
                x_even = tl.load(x_rows, mask=m_mask[:, None], other=0.0)
                x_odd = tl.load(x_rows + 1, mask=m_mask[:, None], other=0.0)
            else:
                x_even = tl.load(x_rows, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                x_odd = tl.load(
                    x_rows + 1, mask=m_mask[:, None] & (offs_k + 1 < K)[None, :], other=0.0
                )
            acc = _dot_acc(x_even, w_even, acc, INTERPRET)
            acc = _dot_acc(x_odd, w_odd, acc, INTERPRET)
        else:
            acc = byte_dot_tile(
                acc, x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, offs_m, offs_n, k0, M, N, K,
                stride_xm, stride_d, stride_s, FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS,
                GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET,
            )  # fmt: skip

    if WEIGHT_LEFT:
        acc = tl.trans(acc)
    store_tile(acc, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, stride_split,
               pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip


_WEIGHT_ONLY = FastLaunch(_weight_only_kernel)


def weight_only_linear(
    x: Float[Tensor, "m k"],
    w: KernelWeight,
    bias: Float[Tensor, " n"] | None,
    cfg: LinearConfig,
) -> Float[Tensor, "m n"]:
    """``x @ W.T + bias`` with ``W`` decoded in-kernel; ``x`` is a contiguous 2-D matrix."""
    m, k = x.shape
    n = w.n
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split = cfg.split_k
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    target = split_target(out, split)
    bias_arg = bias if bias is not None else x
    with on_device(x.device):
        _WEIGHT_ONLY.launch(
            (tiles, split), x, *kernel_args(w), bias_arg, out, target.partials,
            m, n, k, x.stride(0), w.data.stride(0), w.scales.stride(0), n, target.stride_split,
            **kernel_constants(w), HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
            EVEN_K=k % cfg.block_k == 0, WEIGHT_LEFT=cfg.path == "gemm" and w.packed,
            GROUP_M=cfg.group_m, INTERPRET=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return target.finish(bias)


class PreparedWeightOnly(PreparedSplitLaunch):
    """:func:`weight_only_linear` of one weight for ``m`` rows of one dtype, prepared once:
    grid, strides, constants and the weight's tensors are fixed, so a call allocates the output
    (and the K splits' partials) and launches (plus the split reduction). The call takes ``x``
    of ``m`` rows in any leading shape and returns ``out_shape``."""

    def __init__(
        self,
        w: KernelWeight,
        m: int,
        dtype: torch.dtype,
        has_bias: bool,
        cfg: LinearConfig,
        out_shape: tuple[int, ...],
    ) -> None:
        split = cfg.split_k
        n, k = w.n, w.k
        data, scales, zeros, global_scale = kernel_args(w)
        slots = self._prepare_outputs(m, n, dtype, has_bias, split, out_shape, data)
        slot = data  # placeholder of a per-call tensor; unused pointers point at the data
        args = (
            slot, data, scales, zeros, global_scale, slot, slot, slot,
            m, n, k, k, w.data.stride(0), w.scales.stride(0), n, m * n if split > 1 else 0,
        )  # fmt: skip
        tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
        self.launch = _WEIGHT_ONLY.prepare(
            (tiles, split), args, slots, self.device, **kernel_constants(w), HAS_BIAS=has_bias,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
            EVEN_K=k % cfg.block_k == 0, WEIGHT_LEFT=cfg.path == "gemm" and w.packed,
            GROUP_M=cfg.group_m, INTERPRET=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
