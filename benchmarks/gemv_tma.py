"""One-row word-wise GEMV with the weight streamed by the tensor memory accelerator (TMA).

The production one-row GEMV (``qlens.kernels.decode_fast``) loads its words into registers and
is limited by the weight bytes each SM keeps in flight (``profile_gemv_h200.md``). Here the
words of every K step arrive by TMA into shared memory, pipelined ``STAGES`` deep, so the bytes
in flight no longer cost registers; the decode and FMAs are the production kernel's own
(``_word_scales``, ``_code_values``, ``_code``). One row, no bias, no K split: an experiment.

Run on an H100/H200: ``python benchmarks/gemv_tma.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/gemv_tma_h200.md``.
"""

from __future__ import annotations

from functools import partial
from typing import no_type_check

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qlens.kernels import dequantize_triton, quantized_linear
from qlens.kernels.configs import choose_config
from qlens.kernels.decode import INT4_C
from qlens.kernels.decode_fast import _FACTOR_C, _code, _code_values, _word_scales
from qlens.kernels.gemv import permute_codes
from qlens.kernels.launch import kernel_args
from qlens.kernels.timing import header, publish, rel_err, rotation, time_graph, time_linear
from qlens.kernels.weights import kernel_weight
from qlens.quant.quantize import quantize_weight


@triton.jit
@no_type_check
def tma_gemv_kernel(
    xp_ptr, w_desc, scale_ptr, zero_ptr, global_ptr, out_ptr, N, K, stride_xj, stride_s,
    FAMILY: tl.constexpr, GROUP_K: tl.constexpr, SCALE_E8M0: tl.constexpr,
    GLOBAL_DIVIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        words = w_desc.load([n0, k0 // 8]).to(tl.uint32, bitcast=True)
        offs_w = (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
        scale, zero = _word_scales(scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_s,
                                   FAMILY, GROUP_K, SCALE_E8M0, False, GLOBAL_DIVIDE, BLOCK_N,
                                   BLOCK_K)  # fmt: skip
        state = _code_values(words, FAMILY, True)
        for j in tl.static_range(8):
            x = tl.load(xp_ptr + j * stride_xj + offs_w, mask=offs_w < stride_xj, other=0.0)
            w = _code(state, zero, j, FAMILY, True)
            if j == 0:
                part = w * x
            else:
                part += w * x
        if FAMILY == INT4_C:
            acc += part * scale
        else:
            acc += (part * _FACTOR_C) * scale
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def tma_linear(x: torch.Tensor, payload, block_n: int, block_k: int, stages: int, warps: int):
    """``x @ W.T`` for one row ``x`` through ``tma_gemv_kernel``."""
    w = kernel_weight(payload)
    words = w.data.view(torch.int32)
    desc = TensorDescriptor.from_tensor(words, [block_n, block_k // 8])
    _, scales, zeros, global_scale = kernel_args(w)
    xp = permute_codes(x, for_dot=False)
    out = torch.empty((1, w.n), dtype=x.dtype, device=x.device)
    tma_gemv_kernel[(triton.cdiv(w.n, block_n),)](
        xp, desc, scales, zeros, global_scale, out, w.n, x.shape[1], xp.stride(1),
        scales.stride(0), FAMILY=w.family, GROUP_K=w.group_k, SCALE_E8M0=w.scale_e8m0,
        GLOBAL_DIVIDE=w.global_divide, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


SHAPES = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
# (BLOCK_N, BLOCK_K, stages, warps)
LAUNCHES = ((4, 1024, 4, 1), (8, 1024, 4, 1), (8, 1024, 6, 1), (16, 1024, 4, 1),
            (16, 1024, 4, 2), (8, 512, 8, 1))  # fmt: skip


def _label(launch: tuple[int, int, int, int]) -> str:
    bn, bk, stages, warps = launch
    return f"TMA {bn}x{bk} st{stages} w{warps}"


def main() -> None:
    dev = torch.device("cuda")
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev)
    )
    rows = [
        "| N x K | scheme | bf16 us | default us | " + " | ".join(_label(la) for la in LAUNCHES)
        + " | best TMA vs bf16 | best TMA vs default | worst rel. err |",
        "|---|---|---|---|" + "---|" * len(LAUNCHES) + "---|---|---|",
    ]  # fmt: skip
    for n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bf16 = rotation(w)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = time_graph([lambda t=t, x=x: F.linear(x, t) for t in bf16])
        for scheme, kw in SCHEMES:
            p0 = quantize_weight(w, scheme, **kw)
            ps = rotation(p0)
            exact = F.linear(x.float(), dequantize_triton(p0, torch.float32)).double()
            default = choose_config(1, n, k, dev, packed_words=True, int4=scheme == "int4")
            t_default = time_linear(ps, x, default)
            times, worst = [], rel_err(quantized_linear(x, p0, config=default), exact)
            for bn, bk, stages, warps in LAUNCHES:
                try:
                    calls = [partial(tma_linear, x, p, bn, bk, stages, warps) for p in ps]
                    times.append(time_graph(calls))
                    worst = max(worst, rel_err(tma_linear(x, p0, bn, bk, stages, warps), exact))
                except (RuntimeError, ValueError, AssertionError) as err:
                    print(f"<!-- {scheme} {bn}x{bk} st{stages} failed: {str(err)[:300]} -->")
                    times.append(float("nan"))
            best = min((t for t in times if t == t), default=float("nan"))
            rows.append(
                f"| {n} x {k} | {scheme} | {t_bf16:.1f} | {t_default:.1f} | "
                + " | ".join(f"{t:.1f}" for t in times)
                + f" | {t_bf16 / best:.2f}x | {t_default / best:.2f}x | {worst:.1e} |"
            )
            print(rows[-1], flush=True)
            del ps
        del bf16
        torch.cuda.empty_cache()
    publish(header("One-row word-wise GEMV, weight by TMA") + "\n".join(rows), "gemv_tma_h200.md")


if __name__ == "__main__":
    main()
