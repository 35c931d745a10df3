"""One-row word-wise GEMV tiles on the 8B decode layers and the largest benchmark layer: rows per
program, K per loop step, warps (side by side along K, 1024 K each, so ``x`` keeps the words'
layout) and pipelining depth, against the dispatcher's launch.

Run on a CUDA GPU: ``python benchmarks/gemv_tiles.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/gemv_tiles_h200.md``.
"""

from __future__ import annotations

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

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
# (BLOCK_N, BLOCK_K, warps, stages)
LAUNCHES = (
    (4, 1024, 1, 1),
    (4, 2048, 1, 1),
    (8, 1024, 1, 3),
    (4, 2048, 2, 1),
    (4, 4096, 4, 1),
    (8, 2048, 2, 1),
    (8, 2048, 2, 3),
    (8, 4096, 4, 1),
    (4, 4096, 4, 2),
    (8, 4096, 4, 2),
)


def _label(launch: tuple[int, int, int, int]) -> str:
    bn, bk, warps, stages = launch
    return f"{bn}x{bk} w{warps} st{stages}"


def main() -> None:
    dev = torch.device("cuda")
    rows = [
        "| N x K | scheme | bf16 us | dispatcher's launch | its us | "
        + " | ".join(_label(la) for la in LAUNCHES)
        + " | best vs bf16 | best vs dispatcher | worst rel. err |",
        "|---|---|---|---|---|" + "---|" * len(LAUNCHES) + "---|---|---|",
    ]  # fmt: skip
    for n, k in SHAPES:
        w = seeded_weight(n, k, dev)
        bf16 = rotation(w)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = time_bf16_linear(bf16, x)
        for scheme, kw in SCHEMES:
            p0 = quantize_weight(w, scheme, **kw)
            ps = rotation(p0)
            exact = F.linear(x.float(), dequantize_triton(p0, torch.float32)).double()
            configs = [
                LinearConfig("gemv", 16, bn, bk, num_warps=warps, num_stages=stages)
                for bn, bk, warps, stages in LAUNCHES
            ]
            chosen = choose_config(1, n, k, dev, packed_words=True, int4=scheme == "int4")
            t_chosen = time_linear(ps, x, chosen)
            times, worst = time_launches(ps, x, configs, exact)
            worst = max(worst, rel_err(quantized_linear(x, p0, config=chosen), exact))
            best = min([t_chosen, *(t for t in times if t == t)])
            label = _label((chosen.block_n, chosen.block_k, chosen.num_warps, chosen.num_stages))
            rows.append(
                f"| {n} x {k} | {scheme} | {t_bf16:.1f} | {label} | {t_chosen:.1f} | "
                + " | ".join(f"{t:.1f}" for t in times)
                + f" | {t_bf16 / best:.2f}x | {t_chosen / best:.2f}x | {worst:.1e} |"
            )
            print(rows[-1], flush=True)
            del ps
        del bf16
        torch.cuda.empty_cache()
    publish(header("One-row word-wise GEMV tiles") + "\n".join(rows), "gemv_tiles_h200.md")


if __name__ == "__main__":
    main()
