"""The packed 4-bit tensor-core GEMV at 32-256 rows, where the dispatcher dequantizes the weight
and calls cuBLAS: rows per program (one program streams its weight tile once for all of
them), tile and warps, against bf16 ``F.linear`` and the dispatcher's launch.

Run on a CUDA GPU: ``python benchmarks/mid_rows.py``; prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/mid_rows_h200.md``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from qlens.kernels import LinearConfig, dequantize_triton, quantized_linear
from qlens.kernels.configs import choose_config
from qlens.kernels.timing import (
    header,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_launches,
    time_linear,
)
from qlens.quant.quantize import quantize_weight

ROW_COUNTS = (32, 64, 128, 256)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
LAUNCHES = (
    (32, 64, 256, 4, 3),
    (64, 64, 256, 4, 3),
    (64, 64, 128, 4, 3),
    (64, 128, 128, 8, 3),
    (128, 64, 128, 8, 3),
)


def _label(launch: tuple[int, int, int, int, int]) -> str:
    bm, bn, bk, warps, stages = launch
    return f"{bm}x{bn}x{bk} w{warps} st{stages}"


def main() -> None:
    dev = torch.device("cuda")
    rows = [
        "| N x K | scheme | M | bf16 us | dispatcher's path | its us | "
        + " | ".join(_label(la) for la in LAUNCHES)
        + " | best vs bf16 | best vs dispatcher | worst rel. err |",
        "|---|---|---|---|---|---|" + "---|" * len(LAUNCHES) + "---|---|---|",
    ]  # fmt: skip
    for (n, k), rows_m in itertools.product(SHAPES, ROW_COUNTS):
        w = seeded_weight(n, k, dev)
        bf16 = rotation(w)
        x = torch.randn(rows_m, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = time_bf16_linear(bf16, x)
        del bf16
        for scheme, kw in SCHEMES:
            p0 = quantize_weight(w, scheme, **kw)
            ps = rotation(p0)
            exact = F.linear(x.float(), dequantize_triton(p0, torch.float32)).double()
            chosen = choose_config(rows_m, n, k, dev, packed_words=True, int4=scheme == "int4")
            t_chosen = time_linear(ps, x, chosen)
            configs = [
                LinearConfig("gemv", bm, bn, bk, num_warps=warps, num_stages=stages)
                for bm, bn, bk, warps, stages in LAUNCHES
            ]
            times, worst = time_launches(ps, x, configs, exact)
            worst = max(worst, rel_err(quantized_linear(x, p0, config=chosen), exact))
            best = min([t_chosen, *(t for t in times if t == t)])
            rows.append(
                f"| {n} x {k} | {scheme} | {rows_m} | {t_bf16:.1f} | {chosen.path} | "
                f"{t_chosen:.1f} | " + " | ".join(f"{t:.1f}" for t in times)
                + f" | {t_bf16 / best:.2f}x | {t_chosen / best:.2f}x | {worst:.1e} |"
            )  # fmt: skip
            print(rows[-1], flush=True)
            del ps
        torch.cuda.empty_cache()
    publish(header("Packed tensor-core GEMV at 32-256 rows") + "\n".join(rows), "mid_rows_h200.md")


if __name__ == "__main__":
    main()
