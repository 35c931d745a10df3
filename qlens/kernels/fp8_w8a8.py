"""W8A8 block FP8: per-token 1 x group activation quantization, then an FP8 tensor-core GEMM
with the activation and weight block scales applied once per K block."""

from typing import no_type_check

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Float8e4m3fn
from torch import Tensor

from qlens.kernels.configs import LinearConfig, require_tile_sizes
from qlens.kernels.decode import e8m0_to_f32
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.launch import on_device
from qlens.kernels.layout_view import FP8_BLOCK, KernelWeight
from qlens.kernels.numerics import cast_out, fp8_act_codes
from qlens.kernels.runtime import interpreting
from qlens.kernels.splits import split_target, store_tile
from qlens.kernels.weight_only import grouped_tile
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.codecs.elements import decode_e8m0

E4M3_MAX = 448.0


@triton.jit
@no_type_check
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, DECODED: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_M`` rows by ``GROUPS`` consecutive groups. Consecutive programs
    walk down the rows, writing consecutive scales of the column-major layout (on the H200
    faster than walking along K, fp8_prefill_h200.md). ``DECODED``: ``q_ptr`` gets ``code *
    scale`` in its own dtype instead of the codes, and no scales are written."""
    n_groups = tl.cdiv(K, GROUP)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g0 = tl.program_id(1) * GROUPS
    offs_g = g0 + tl.arange(0, GROUPS)
    offs_k = g0 * GROUP + tl.arange(0, GROUPS * GROUP)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    codes, scale = fp8_act_codes(
        tl.reshape(x.to(tl.float32), (BLOCK_M, GROUPS, GROUP)), 2, INTERPRET
    )
    if DECODED:
        decoded = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        decoded = cast_out(
            tl.reshape(decoded, (BLOCK_M, GROUPS * GROUP)), q_ptr.dtype.element_ty, INTERPRET
        )
        tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], decoded, mask=mask)
    else:
        codes = tl.reshape(codes, (BLOCK_M, GROUPS * GROUP))
        tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], codes, mask=mask)
        s_mask = (offs_m < M)[:, None] & (offs_g < n_groups)[None, :]
        tl.store(
            s_ptr + offs_m[:, None] * stride_sm + offs_g[None, :] * stride_sg, scale, mask=s_mask
        )


_ACT_QUANT = FastLaunch(_act_quant_kernel)


# Activation-quantization program on a GPU: rows by groups.
ACT_QUANT_BLOCK_M = 16
ACT_QUANT_GROUPS = 1


def quantize_activations(
    x: Float[Tensor, "m k"],
    group: int = 128,
    *,
    block_m: int | None = None,
    groups: int | None = None,
) -> tuple[Float8e4m3fn[Tensor, "m k"], Float[Tensor, "m groups"]]:
    """Per-token, per-``group`` dynamic FP8: ``x ~ q * s`` with ``s = amax / 448`` (1 for zeros).

    Returns e4m3 codes ``[m, k]`` and float32 scales ``[m, ceil(k / group)]`` stored
    column-major (strides ``(1, m)``), the layout cuBLAS' blockwise FP8 GEMM takes, so no
    transposing copy follows. ``block_m`` and ``groups`` override the rows and the groups
    (a power of two) per program (benchmarks sweep them).
    """
    m, k = x.shape
    n_groups = ceil_div(k, group)
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scales = torch.empty((n_groups, m), dtype=torch.float32, device=x.device).t()
    overrides = {"block_m": block_m, "groups": groups}
    require_tile_sizes(1, **{name: v for name, v in overrides.items() if v is not None})
    _launch_act_quant(x, codes, scales, group, block_m, groups)
    return codes.view(torch.float8_e4m3fn), scales


def fp8_rounded_rows(x: Float[Tensor, "m k"], group: int = 128) -> Float[Tensor, "m k"]:
    """``x`` as W8A8 reads it, in one launch: :func:`quantize_activations`' codes times their
    scales, rounded to ``x``'s dtype (``reference.fp8_rounded_activations(x, group)
    .to(x.dtype)``, bit for bit)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_act_quant(x, out, out, group, None, None)
    return out


def _launch_act_quant(
    x: Tensor,
    out: Tensor,
    scales: Tensor,
    group: int,
    block_m: int | None,
    groups: int | None,
) -> None:
    """The act-quant launch: codes and scales, or (``out`` not uint8) decoded values only;
    ``block_m`` and ``groups`` checked by the caller, None for the defaults."""
    m, k = x.shape
    if block_m is None:
        block_m = 64 if interpreting() else ACT_QUANT_BLOCK_M
    if groups is None:
        groups = 4 if interpreting() else ACT_QUANT_GROUPS
    grid = (ceil_div(m, block_m), ceil_div(ceil_div(k, group), groups))
    decoded = out.dtype != torch.uint8
    with on_device(x.device):
        _ACT_QUANT.launch(
            grid, x, out, scales, m, k, x.stride(0), out.stride(0), scales.stride(0),
            scales.stride(-1), GROUP=group, BLOCK_M=block_m, GROUPS=groups, DECODED=decoded,
            INTERPRET=interpreting(),
        )  # fmt: skip


@triton.jit
@no_type_check
def _fp8_block_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_om, stride_split,
    GROUP_N: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    kb_begin = pid_k * per_split
    kb_end = tl.minimum(kb_begin + per_split, steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0,
        ).to(tl.float8e4nv, bitcast=True)
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        ).to(tl.float8e4nv, bitcast=True)
        a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_asg, mask=m_mask, other=1.0)
        w_s = tl.load(ws_ptr + (offs_n // GROUP_N) * stride_wsn + kb, mask=n_mask, other=1)
        if SCALE_E8M0:
            w_s = e8m0_to_f32(w_s)
        if INTERPRET:
            d = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            d = tl.dot(a, tl.trans(w))
        acc += d * a_s[:, None] * w_s.to(tl.float32)[None, :]

    store_tile(acc, out_ptr, partial_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, stride_split,
               pid_k, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip


_FP8_BLOCK_GEMM = FastLaunch(_fp8_block_gemm_kernel)


def fp8_block_w8a8_linear(
    x: Float[Tensor, "m k"],
    w: KernelWeight,
    bias: Float[Tensor, " n"] | None,
    cfg: LinearConfig,
) -> Float[Tensor, "m n"]:
    """``quant(x) @ W.T + bias`` for a block-FP8 weight, activations quantized per token."""
    if w.family != FP8_BLOCK:
        raise ValueError(f"W8A8 runs fp8_block weights only, got {w.name}")
    if w.group_k > 256:
        raise ValueError(f"W8A8 needs a weight block of at most 256 along K, got {w.group_k}")
    m, k = x.shape
    n = w.n
    a, a_scales = quantize_activations(x, w.group_k)
    if cfg.path == "cublas" and cublas_blockwise_fits(m, w, x.device, x.dtype):
        return _cublas_blockwise(a, a_scales, w, bias, x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split = cfg.split_k if cfg.path == "splitk" else 1
    block_m = cfg.block_m if cfg.path != "cublas" else (128 if m > 64 else 64)
    tiles = ceil_div(m, block_m) * ceil_div(n, cfg.block_n)
    target = split_target(out, split)
    bias_arg = bias if bias is not None else x
    with on_device(x.device):
        _FP8_BLOCK_GEMM.launch(
            (tiles, split),
            a.view(torch.uint8), a_scales, w.data.view(torch.uint8), w.scales, bias_arg, out,
            target.partials,
            m, n, k, a.stride(0), a_scales.stride(0), a_scales.stride(1), w.data.stride(0),
            w.scales.stride(0), n, target.stride_split,
            GROUP_N=w.group_n, SCALE_E8M0=w.scale_e8m0, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=w.group_k, SPLIT_K=split,
            GROUP_M=cfg.group_m, INTERPRET=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return target.finish(bias)


def cublas_blockwise_fits(
    m: int, w: KernelWeight, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether cuBLAS' blockwise FP8 GEMM (``torch._scaled_mm``, Hopper) takes this product.

    It needs 1x128 activation and 128x128 weight blocks, whole blocks along N and K, a K block
    count divisible by 4, M a multiple of 16 and bf16 output (the case measured and tested).
    """
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and not interpreting()
        and torch.cuda.get_device_capability(device) == (9, 0)
        and (w.group_n, w.group_k) == (128, 128)
        and w.n % 128 == 0
        and w.k % 512 == 0
        and m % 16 == 0
    )


def _cublas_blockwise(
    a: Float8e4m3fn[Tensor, "m k"],
    a_scales: Float[Tensor, "m groups"],
    w: KernelWeight,
    bias: Float[Tensor, " n"] | None,
    dtype: torch.dtype,
) -> Float[Tensor, "m n"]:
    """The FP8 GEMM by cuBLAS on qlens' quantized activations (same scales, same codes)."""
    w_scales = decode_e8m0(w.scales) if w.scale_e8m0 else w.scales
    out = torch._scaled_mm(
        a,
        w.data.t(),
        scale_a=a_scales,  # column-major, as cuBLAS requires
        scale_b=w_scales.t(),
        out_dtype=dtype,
    )
    return out if bias is None else out.add_(bias)
