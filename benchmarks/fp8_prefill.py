"""W8A8 block FP8 at large M: activation quantization bandwidth and the whole linear against
cuBLAS' blockwise FP8 GEMM alone and bf16 ``F.linear``.

- activation quantization (bf16 -> e4m3 codes + float32 1 x 128 scales) for several programs
  (rows x groups), in TB/s of bytes read and written, against the same-run copy ceiling; and
  the same followed by the transposing copy of its scales that the row-major layout needed before the
  scales were written column-major;
- ``quantized_linear(x, fp8-block weight, w8a8=True)`` (quantization + cuBLAS blockwise GEMM)
  against the GEMM alone on pre-quantized activations and against bf16.

Run on a CUDA GPU: ``python benchmarks/fp8_prefill.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/fp8_prefill_<gpu>.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _timing import (
    BENCHMARK_LAYERS,
    clone_payload,
    copies_for,
    copy_bandwidths,
    header,
    publish,
    rotation,
    seeded_weight,
    time_graph,
    time_linear,
)

from qlens.kernels.fp8_w8a8 import ACT_QUANT_BLOCK_M, ACT_QUANT_GROUPS, quantize_activations
from qlens.quant.quantize import quantize_weight

ACT_SHAPES = ((1024, 4096), (4096, 4096), (1024, 14336), (4096, 8192), (4096, 14336))
# (rows, groups) per activation-quantization program
ACT_LAUNCHES = ((16, 1), (32, 1), (16, 2), (16, 4), (32, 2), (32, 4), (8, 4), (16, 8))
M_VALUES = (1024, 4096)


def _act_quant_rows(copy_tbs: float) -> list[str]:
    rows = [
        "| M x K | " + " | ".join(f"{b}x{g} us (TB/s)" for b, g in ACT_LAUNCHES)
        + " | default + scale transpose us | best % of copy |",
        "|---|" + "---|" * (len(ACT_LAUNCHES) + 2),
    ]  # fmt: skip
    for m, k in ACT_SHAPES:
        nbytes = m * k * 3 + m * (k // 128) * 4
        xs = [
            torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies_for(nbytes))
        ]
        times = {
            (b, g): time_graph(
                [lambda x=x, b=b, g=g: quantize_activations(x, block_m=b, groups=g) for x in xs]
            )
            for b, g in ACT_LAUNCHES
        }
        transposed = time_graph(
            [lambda x=x: quantize_activations(x)[1].contiguous() for x in xs]
        )  # fmt: skip
        best = min(times.values())
        cells = " | ".join(f"{t:.1f} ({nbytes / t / 1e6:.2f})" for t in times.values())
        rows.append(
            f"| {m} x {k} | {cells} | {transposed:.1f} | {100 * nbytes / best / 1e6 / copy_tbs:.0f}% |"
        )
        print(rows[-1], flush=True)
    return rows


def _gemm_only(a, a_scales, w_data, w_scales):
    return torch._scaled_mm(
        a, w_data.t(), scale_a=a_scales, scale_b=w_scales.t(), out_dtype=torch.bfloat16
    )


def _linear_rows() -> list[str]:
    rows = [
        "| M | N | K | bf16 us | qlens W8A8 us (vs bf16) | cuBLAS GEMM alone us (vs bf16) | "
        "qlens vs GEMM alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, k in BENCHMARK_LAYERS:
        w = seeded_weight(n, k)
        count = copies_for(n * k)
        fp8 = [quantize_weight(w, "fp8-block")]
        fp8 += [clone_payload(fp8[0]) for _ in range(count - 1)]
        ws = rotation(w)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, a_s = quantize_activations(x)
            t_bf16 = time_graph([lambda wb=wb, x=x: F.linear(x, wb) for wb in ws])
            t_qlens = time_linear(fp8, x, w8a8=True)
            t_gemm = time_graph(
                [lambda p=p, a=a, s=a_s: _gemm_only(a, s, p.data, p.scales) for p in fp8]
            )
            rows.append(
                f"| {m} | {n} | {k} | {t_bf16:.1f} | {t_qlens:.1f} ({t_bf16 / t_qlens:.2f}x) | "
                f"{t_gemm:.1f} ({t_bf16 / t_gemm:.2f}x) | {t_gemm / t_qlens:.2f}x |"
            )
            print(rows[-1], flush=True)
        del ws, fp8
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    copies = copy_bandwidths()
    copy_tbs = max(copies.values())
    out = [
        header("qlens W8A8 block FP8 at large M"),
        "- copy ceiling: " + ", ".join(f"{name} {tbs:.2f} TB/s" for name, tbs in copies.items()),
        "- default activation-quantization program (rows x groups): "
        f"{ACT_QUANT_BLOCK_M}x{ACT_QUANT_GROUPS}",
        "",
        "## Activation quantization (bf16 in; e4m3 codes and float32 scales out; rows x groups)",
        "",
        *_act_quant_rows(copy_tbs),
        "",
        "## Whole linear",
        "",
        *_linear_rows(),
    ]
    publish("\n".join(out), "fp8_prefill_h200.md")


if __name__ == "__main__":
    main()
