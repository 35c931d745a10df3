"""The pair-decoding int4 tensor-core GEMV (``qlens.kernels.int4_pairs``) against the current
default launch and bf16 ``F.linear`` on the 8B decode layers and the largest benchmark layer,
for 1 and 16 rows: a launch sweep (rows of the weight per program, K per step, warps, pipelining
depth; K splits as the dispatcher would choose them for the ``pairs`` path).

Run on a CUDA GPU: ``python benchmarks/int4_pairs.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/int4_pairs_h200.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from qlens.kernels import LinearConfig, dequantize_triton, quantized_linear
from qlens.kernels.configs import split_k_for
from qlens.kernels.timing import header, publish, rotation, time_graph
from qlens.quant.quantize import quantize_weight

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (
    ("int4 g128", {"group_size": 128}),
    ("int4 g128 asym", {"group_size": 128, "asymmetric": True, "scale_dtype": "bf16"}),
)
ROWS = (1, 16)
# (BLOCK_N, BLOCK_K, warps, stages)
LAUNCHES = (
    (128, 128, 4, 3),
    (32, 128, 1, 1),
    (32, 128, 1, 3),
    (32, 256, 1, 3),
    (64, 128, 1, 3),
    (64, 256, 1, 3),
    (32, 512, 1, 2),
    (64, 128, 2, 3),
    (128, 128, 4, 4),
    (128, 256, 4, 3),
)


def _label(launch: tuple[int, int, int, int]) -> str:
    bn, bk, warps, stages = launch
    return f"{bn}x{bk} w{warps} st{stages}"


def main() -> None:
    dev = torch.device("cuda")
    rows = [
        "| N x K | scheme | M | bf16 us | default us | "
        + " | ".join(_label(la) for la in LAUNCHES)
        + " | best vs bf16 | best vs default | best TB/s | worst rel. err (rounding) |",
        "|---|---|---|---|---|" + "---|" * len(LAUNCHES) + "---|---|---|---|",
    ]  # fmt: skip
    for n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bf16 = rotation(w)
        for scheme, kw in SCHEMES:
            if "asym" in scheme and n * k < 28672 * 4096:
                continue
            p0 = quantize_weight(w, "int4", **kw)
            ps = rotation(p0)
            nbytes = p0.data.numel() + p0.scales.numel() * p0.scales.element_size()
            for m in ROWS:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_bf16 = time_graph([lambda t=t, x=x: F.linear(x, t) for t in bf16])
                t_default = time_graph([lambda p=p, x=x: quantized_linear(x, p) for p in ps])
                exact = F.linear(x.double(), dequantize_triton(p0, torch.float32).double())
                rounding = ((exact.bfloat16().double() - exact).norm() / exact.norm()).item()
                times, worst = [], 0.0
                for bn, bk, warps, stages in LAUNCHES:
                    cfg = LinearConfig("pairs", 16, bn, bk, num_warps=warps, num_stages=stages)
                    cfg = replace(cfg, split_k=split_k_for(m, n, k, cfg, dev))
                    try:
                        times.append(
                            time_graph(
                                [lambda p=p, x=x, c=cfg: quantized_linear(x, p, config=c) for p in ps]
                            )
                        )  # fmt: skip
                        out = quantized_linear(x, p0, config=cfg).double()
                        worst = max(worst, ((out - exact).norm() / exact.norm()).item())
                    except (RuntimeError, ValueError) as err:
                        print(f"<!-- {scheme} {cfg} failed: {str(err)[:300]} -->", flush=True)
                        times.append(float("nan"))
                best = min((t for t in times if t == t), default=float("nan"))
                rows.append(
                    f"| {n} x {k} | {scheme} | {m} | {t_bf16:.1f} | {t_default:.1f} | "
                    + " | ".join(f"{t:.1f}" for t in times)
                    + f" | {t_bf16 / best:.2f}x | {t_default / best:.2f}x | "
                    f"{nbytes / best / 1e6:.2f} | {worst:.1e} ({rounding:.1e}) |"
                )
                print(rows[-1], flush=True)
            del ps
        del bf16
        torch.cuda.empty_cache()
    publish(
        header("int4 pair-decoding tensor-core GEMV: launch sweep") + "\n".join(rows),
        "int4_pairs_h200.md",
    )


if __name__ == "__main__":
    main()
