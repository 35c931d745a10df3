"""Word-wise 4-bit GEMV on tensor cores (M = 16): the decoded weight as the dots' right operand
(staged through shared memory) against the left one (read by Hopper's tensor cores from
registers), per launch, against bf16 ``F.linear`` in the same run.

Run on a CUDA GPU: ``python benchmarks/dot_operand_order.py``; prints markdown and, when
``$OUT`` is set, writes it to ``$OUT/dot_operand_order_h200.md``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qlens.kernels import LinearConfig, dequantize_triton, quantized_linear
from qlens.kernels.gemv import DOT_W_LEFT_ENV
from qlens.kernels.timing import clone_payload, copies_for, header, publish, time_graph
from qlens.quant.quantize import quantize_weight

SHAPES = ((28672, 8192), (4096, 4096), (14336, 4096), (4096, 14336))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
LAUNCHES = ((64, 128, 4), (128, 128, 4), (64, 256, 4), (128, 256, 8))
M = 16


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _timed(ps, x, cfg: LinearConfig, w_left: bool) -> tuple[float, torch.Tensor]:
    os.environ[DOT_W_LEFT_ENV] = "1" if w_left else "0"
    try:
        out = quantized_linear(x, ps[0], config=cfg)
        return time_graph([lambda q=q: quantized_linear(x, q, config=cfg) for q in ps]), out
    finally:
        os.environ.pop(DOT_W_LEFT_ENV, None)


def main() -> None:
    rows = [
        "| N x K | scheme | launch | weight right us | weight left us | bf16 us "
        "| speed-up right / left | rel. err right / left |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        bf16 = [w] + [w.clone() for _ in range(copies_for(n * k * 2) - 1)]
        base = time_graph([lambda t=t, x=x: F.linear(x, t) for t in bf16])
        del bf16
        for scheme, kw in SCHEMES:
            p = quantize_weight(w, scheme, **kw)
            ps = [p] + [clone_payload(p) for _ in range(copies_for(p.nbytes) - 1)]
            ref = F.linear(x.double(), dequantize_triton(p, torch.float32).double())
            for bn, bk, warps in LAUNCHES:
                cfg = LinearConfig("gemv", 16, bn, bk, num_warps=warps)
                right, out_r = _timed(ps, x, cfg, False)
                left, out_l = _timed(ps, x, cfg, True)
                rows.append(
                    f"| {n} x {k} | {scheme} | {bn}x{bk} w{warps} | {right:.1f} | {left:.1f} | "
                    f"{base:.1f} | {base / right:.2f}x / {base / left:.2f}x | "
                    f"{_rel_err(out_r, ref):.1e} / {_rel_err(out_l, ref):.1e} |"
                )
                print(rows[-1], flush=True)
            del ps
        del w
        torch.cuda.empty_cache()
    publish("\n".join([header(f"Tensor-core GEMV operand order, M = {M}"), "", *rows]),
            "dot_operand_order_h200.md")  # fmt: skip


if __name__ == "__main__":
    main()
