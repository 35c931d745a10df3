"""Register caps (``LinearConfig.max_registers``, Triton's ``maxnreg``) on the one-row word-wise
GEMV: fewer registers per thread let more one-warp programs stay resident on an SM, so more
weight bytes are in flight, at the price of spills. Default tiles of the dispatcher, 8B decode
layers and the largest benchmark layer, every 4-bit scheme.

Run on a CUDA GPU: ``python benchmarks/gemv_registers.py``; prints markdown and, when ``$OUT``
is set, writes it to ``$OUT/gemv_registers_h200.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from qlens.kernels import choose_config, dequantize_triton, quantized_linear
from qlens.kernels.timing import header, publish, rotation, time_graph
from qlens.quant.quantize import quantize_weight

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
CAPS = (None, 56, 64, 72, 80, 96)
ROWS = (1, 4)


def main() -> None:
    dev = torch.device("cuda")
    rows = [
        "| N x K | scheme | M | launch | bf16 us | "
        + " | ".join(f"cap {c}" if c else "no cap" for c in CAPS)
        + " | best vs bf16 | best vs no cap | best TB/s | worst rel. err |",
        "|---|---|---|---|---|" + "---|" * len(CAPS) + "---|---|---|---|",
    ]  # fmt: skip
    for n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bf16 = rotation(w)
        for scheme, kw in SCHEMES:
            p0 = quantize_weight(w, scheme, **kw)
            ps = rotation(p0)
            nbytes = p0.data.numel() + p0.scales.numel() * p0.scales.element_size()
            for m in ROWS:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_bf16 = time_graph([lambda t=t, x=x: F.linear(x, t) for t in bf16])
                exact = F.linear(x.double(), dequantize_triton(p0, torch.float32).double())
                base = choose_config(m, n, k, dev, packed_words=True)
                times, worst = [], 0.0
                for cap in CAPS:
                    cfg = replace(base, max_registers=cap)
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
                launch = f"{base.block_n}x{base.block_k} w{base.num_warps} split {base.split_k}"
                rows.append(
                    f"| {n} x {k} | {scheme} | {m} | {launch} | {t_bf16:.1f} | "
                    + " | ".join(f"{t:.1f}" for t in times)
                    + f" | {t_bf16 / best:.2f}x | {times[0] / best:.2f}x | "
                    f"{nbytes / best / 1e6:.2f} | {worst:.1e} |"
                )
                print(rows[-1], flush=True)
            del ps
        del bf16
        torch.cuda.empty_cache()
    publish(
        header("Register caps on the word-wise GEMV") + "\n".join(rows), "gemv_registers_h200.md"
    )


if __name__ == "__main__":
    main()
