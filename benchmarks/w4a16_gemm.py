"""A W4A16 GEMM for 64-4096 rows with the weight as the left operand: ``out^T = W x^T``.

The packed 4-bit weight tile is decoded in registers and fed to Hopper's tensor cores as their
register operand (``wgmma`` takes A from registers, B from shared memory), while the K loop's
software pipeline streams the packed bytes and the activations into shared memory. In a local
sm_90 compile (Triton 3.6) the decode lands directly in the dot-operand layout, with no
shared-memory round trip of the decoded tile, which is what made qlens' ``gemm`` path (the
decoded weight as the right operand) slow. This script times that kernel against bf16
``F.linear`` and qlens' dispatcher (dequantize + cuBLAS at these sizes) on the benchmark
layers, with a launch sweep, and checks every launch against the float32 product.

Not a qlens path yet: the dispatcher takes it only once this script shows where it wins.

Run on a CUDA GPU: ``python benchmarks/w4a16_gemm.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/w4a16_gemm_h200.md``.
"""

from __future__ import annotations

import functools
import itertools
from typing import no_type_check

import torch
import triton
import triton.language as tl

from qlens.kernels.decode import decode_packed_halves
from qlens.kernels.launch import kernel_args, kernel_constants, on_device
from qlens.kernels.linear import grouped_tile
from qlens.kernels.runtime import interpreting
from qlens.kernels.timing import (
    header,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_graph,
    time_linear,
)
from qlens.kernels.weights import kernel_weight
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

ROW_COUNTS = (64, 256, 1024, 4096)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
# (weight rows, activation rows, K, warps, stages) per program.
LAUNCHES = (
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 128, 128, 4, 4),
    (128, 64, 128, 4, 3),
    (64, 64, 128, 4, 3),  # more programs for the 4096-row layers at 64-256 rows
)


@triton.jit
@no_type_check
def swapped_w4a16_kernel(
    x_ptr, data_ptr, scale_ptr, zero_ptr, global_ptr, out_ptr,
    M, N, K, stride_xm, stride_d, stride_s, stride_om,
    FAMILY: tl.constexpr, PACKED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_ZEROS: tl.constexpr, GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, GROUP_TILES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``out[m, n] = sum_k x[m, k] W[n, k]`` as ``[BLOCK_N, BLOCK_M]`` tiles of ``W x^T``."""
    pid_n, pid_m = grouped_tile(tl.program_id(0), N, M, BLOCK_N, BLOCK_M, GROUP_TILES)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        even, odd = decode_packed_halves(
            data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
            FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
        )  # fmt: skip
        w = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
            mask=(offs_m < M)[None, :] & ((offs_k < K)[:, None] | EVEN_K),
            other=0.0,
        )
        if INTERPRET:  # the interpreter multiplies bf16 bit patterns: compute in float32
            acc = tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(xt.dtype), xt, acc)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], out, mask=mask)


def swapped_w4a16_linear(
    x: torch.Tensor, payload: QuantPayload, launch: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """``x @ W.T`` for a packed 4-bit qlens payload (int4, MXFP4, NVFP4), ``x`` ``[m, k]``."""
    block_n, block_m, block_k, warps, stages = launch
    w = kernel_weight(payload)
    if not w.packed:
        raise ValueError(f"the swapped W4A16 kernel reads packed 4-bit weights, not {w.family}")
    m, k = x.shape
    out = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(w.n, block_n) * triton.cdiv(m, block_m),)
    with on_device(x.device):
        swapped_w4a16_kernel[grid](
            x, *kernel_args(w), out, m, w.n, k, x.stride(0), w.data.stride(0), w.scales.stride(0),
            out.stride(0), **kernel_constants(w), BLOCK_N=block_n, BLOCK_M=block_m,
            BLOCK_K=block_k, EVEN_K=k % block_k == 0, STAGES=stages, GROUP_TILES=8,
            INTERPRET=interpreting(), num_warps=warps,
        )  # fmt: skip
    return out


def main() -> None:
    from qlens.kernels.dequant import dequantize_triton

    labels = [f"{bn}x{bm}x{bk} w{wp} st{st}" for bn, bm, bk, wp, st in LAUNCHES]
    rows = [
        "| N x K | scheme | M | bf16 us | dispatcher us | " + " | ".join(labels)
        + " | best vs bf16 | best vs dispatcher | worst rel. err |",
        "|---|---|---|---|---|" + "---|" * len(LAUNCHES) + "---|---|---|",
    ]  # fmt: skip
    for (n, k), m in itertools.product(SHAPES, ROW_COUNTS):
        w = seeded_weight(n, k)
        bf16 = rotation(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_bf16 = time_bf16_linear(bf16, x)
        del bf16
        for scheme, options in SCHEMES:
            p0 = quantize_weight(w, scheme, **options)
            payloads = rotation(p0)
            exact = torch.nn.functional.linear(x.float(), dequantize_triton(p0, torch.float32))
            t_disp = time_linear(payloads, x)
            times, worst = [], 0.0
            for launch in LAUNCHES:
                try:
                    calls = [
                        functools.partial(swapped_w4a16_linear, x, p, launch) for p in payloads
                    ]
                    times.append(time_graph(calls))
                    worst = max(worst, rel_err(swapped_w4a16_linear(x, p0, launch), exact))
                except (RuntimeError, ValueError) as err:
                    print(f"<!-- {launch} failed: {str(err)[:200]} -->", flush=True)
                    times.append(float("nan"))
            best = min([t for t in times if t == t], default=float("nan"))
            rows.append(
                f"| {n} x {k} | {scheme} | {m} | {t_bf16:.1f} | {t_disp:.1f} | "
                + " | ".join(f"{t:.1f}" for t in times)
                + f" | {t_bf16 / best:.2f}x | {t_disp / best:.2f}x | {worst:.1e} |"
            )  # fmt: skip
            print(rows[-1], flush=True)
            del payloads
        torch.cuda.empty_cache()
    publish(
        header("W4A16 GEMM, weight as the left operand") + "\n".join(rows), "w4a16_gemm_h200.md"
    )


if __name__ == "__main__":
    main()
