"""W4A16 decode (M = 1 and 16) against bf16 ``F.linear``, with a launch sweep and a parity check.

Run on a CUDA GPU: ``python benchmarks/kernels_decode.py [--no-sweep]``; prints markdown and,
when ``$OUT`` is set, writes it to ``$OUT/kernels_decode_h200.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from qlens.kernels import LinearConfig, choose_config, dequantize_triton, quantized_linear
from qlens.kernels.configs import split_k_for
from qlens.kernels.timing import copies_for, header, time_graph
from qlens.quant.quantize import quantize_weight

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
BYTES_PER_WEIGHT = {"int4": 0.5 + 4 / 128, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
COPY_TBPS = 4.27  # device-to-device copy ceiling measured on this H200 (DESIGN.md section 5)
# (M, BLOCK_N, BLOCK_K, warps) of the GEMV path tried on the largest layer.
SWEEP = (
    (1, 16, 512, 4), (1, 32, 256, 4), (1, 16, 1024, 8), (1, 32, 512, 8),
    (16, 64, 128, 4), (16, 32, 128, 4), (16, 128, 128, 8), (16, 64, 256, 8),
)  # fmt: skip


def _safe(what: str, fn: Callable[[], float]) -> float:
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError, AssertionError) as err:
        print(f"<!-- {what} failed: {str(err)[:300]} -->", flush=True)
        return float("nan")


def _copies(p, count):
    out = [p]
    for _ in range(count - 1):
        q = copy.copy(p)
        for name in ("data", "scales", "zeros", "global_scale"):
            t = getattr(p, name)
            if t is not None:
                setattr(q, name, t.clone())
        out.append(q)
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _launch(m: int, n: int, k: int, bn: int, bk: int, warps: int, path="gemv") -> LinearConfig:
    """A launch with the dispatcher's K split for these tiles on the GPU."""
    cfg = LinearConfig(path, 16, bn, bk, num_warps=warps)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return replace(cfg, split_k=split_k_for(m, n, k, cfg, dev))


def bench(sweep: bool, dev: torch.device) -> str:
    rows, checks, sweep_rows = [], [], []
    for n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bf16 = [w] + [w.clone() for _ in range(copies_for(n * k * 2) - 1)]
        payloads = {
            s: _copies(quantize_weight(w, s, **kw), copies_for(n * k // 2)) for s, kw in SCHEMES
        }
        for m in (1, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = _safe(
                "bf16", lambda x=x, b=bf16: time_graph([lambda t=t: F.linear(x, t) for t in b])
            )
            cfg = choose_config(m, n, k, dev)
            cells = {}
            for s, _ in SCHEMES:
                ps = payloads[s]
                cells[s] = _safe(
                    f"{s} {m}x{n}x{k}",
                    lambda ps=ps, x=x: time_graph([lambda p=p: quantized_linear(x, p) for p in ps]),
                )
                ref = F.linear(x.float(), dequantize_triton(ps[0], torch.float32))
                checks.append((s, m, n, k, _safe(s, lambda p=ps[0], x=x, r=ref: _rel_err(
                    quantized_linear(x, p), r))))  # fmt: skip
                if m == 16:
                    alt = _launch(m, n, k, 64, 128, 4)
                    cells[s + " gemv"] = _safe(
                        f"{s} tensor-core GEMV at M=16",
                        lambda ps=ps, x=x, c=alt: time_graph(
                            [lambda p=p: quantized_linear(x, p, config=c) for p in ps]
                        ),
                    )
                    checks.append((s + " gemv", m, n, k, _safe(s, lambda p=ps[0], x=x, r=ref,
                        c=alt: _rel_err(quantized_linear(x, p, config=c), r))))  # fmt: skip
            rows.append((m, n, k, cfg, base, cells))
            print(f"<!-- {m}x{n}x{k} bf16={base:.1f} {cells} -->", flush=True)
        if sweep and (n, k) == SHAPES[-1]:
            for s, _ in SCHEMES:
                for m, bn, bk, warps in SWEEP:
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    c = _launch(m, n, k, bn, bk, warps)
                    us = _safe(
                        f"sweep {s} {c}",
                        lambda ps=payloads[s], c=c, x=x: time_graph(
                            [lambda p=p: quantized_linear(x, p, config=c) for p in ps]
                        ),
                    )
                    sweep_rows.append((s, m, bn, bk, warps, c.split_k, us))
                    print(f"<!-- sweep {s} M={m} {bn}x{bk} w{warps}: {us:.1f} -->", flush=True)
        del bf16, payloads, w
        torch.cuda.empty_cache()

    out = [header("W4A16 decode on the H200"), "## Time (us) and speed-up over bf16 F.linear", ""]
    out += [
        "| M | N | K | path | bf16 | int4 | mxfp4 | nvfp4 | int4 % copy BW | mxfp4 % | nvfp4 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, n, k, cfg, base, cells in rows:
        times = [f"{cells[s]:.1f} ({base / cells[s]:.2f}x)" for s, _ in SCHEMES]
        bw = [
            f"{n * k * BYTES_PER_WEIGHT[s] / cells[s] / 1e6 / COPY_TBPS * 100:.0f}%"
            for s, _ in SCHEMES
        ]
        path = f"{cfg.path} {cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps}"
        out.append(f"| {m} | {n} | {k} | {path} | {base:.1f} | " + " | ".join(times + bw) + " |")
    out += ["", "## M = 16 on the word-wise tensor-core GEMV (64x128, 4 warps), same run", ""]
    out += ["| N | K | bf16 | int4 | mxfp4 | nvfp4 |", "|---|---|---|---|---|---|"]
    for m, n, k, _, base, cells in rows:
        if m == 16:
            cols = [
                f"{cells[s + ' gemv']:.1f} ({base / cells[s + ' gemv']:.2f}x)" for s, _ in SCHEMES
            ]
            out.append(f"| {n} | {k} | {base:.1f} | " + " | ".join(cols) + " |")
    if sweep_rows:
        out += ["", f"## GEMV sweep, {SHAPES[-1][0]} x {SHAPES[-1][1]}", ""]
        out += [
            "| weight | M | BLOCK_N x BLOCK_K | warps | split | us |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {s} | {m} | {bn}x{bk} | {w} | {sp} | {us:.1f} |"
            for s, m, bn, bk, w, sp, us in sweep_rows
        ]
    out += ["", "## Parity: relative Frobenius error vs dequantize (fp32) + F.linear", ""]
    out += ["| weight | M | N | K | rel err |", "|---|---|---|---|---|"]
    out += [f"| {s} | {m} | {n} | {k} | {e:.2e} |" for s, m, n, k, e in checks]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch sweep")
    args = parser.parse_args()
    text = bench(not args.no_sweep, torch.device("cuda"))
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kernels_decode_h200.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
