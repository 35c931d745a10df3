"""Dequantize kernels vs eager torch and torch.compile, as a share of copy bandwidth.

Run on a CUDA GPU: ``python benchmarks/dequant.py``; prints markdown. Bandwidth counts the
packed bytes read (data, scales, zeros) plus the bf16 bytes written.
"""

from __future__ import annotations

import os

import torch

from qlens.kernels import dequantize_triton
from qlens.kernels.timing import copy_bandwidth, header, time_eager, time_graph
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

SCHEMES = (
    ("fp8-block", {}),
    ("fp8-block", {"scale_dtype": "e8m0"}),
    ("mxfp8", {}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 128, "asymmetric": True}),
    ("int8", {"group_size": 128}),
)
SHAPE = (28672, 8192)


def _time(fn, graph=True):
    try:
        return time_graph([fn], replays=10) if graph else time_eager(fn)
    except (RuntimeError, ValueError, TypeError, AssertionError) as err:
        print(f"<!-- failed: {str(err)[:300]} -->")
        return float("nan")


def main():
    copy_tbs = copy_bandwidth()
    out = [
        header("qlens dequantize kernels"),
        f"- copy bandwidth (read + write): "
        f"{copy_tbs:.2f} TB/s; shape {SHAPE[0]} x {SHAPE[1]} -> bf16",
        "",
        "| scheme | bytes in+out (MB) | Triton us | TB/s | % of copy | eager us | "
        "torch.compile us | bit-exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    torch.manual_seed(0)
    w = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) * 0.02
    compiled = torch.compile(dequantize, dynamic=False)
    for scheme, kw in SCHEMES:
        p = quantize_weight(w, scheme, **kw)
        nbytes = p.nbytes + w.numel() * 2
        exact = torch.equal(dequantize_triton(p, torch.bfloat16), dequantize(p, torch.bfloat16))
        t = _time(lambda p=p: dequantize_triton(p, torch.bfloat16))
        eager = _time(lambda p=p: dequantize(p, torch.bfloat16), graph=False)
        comp = _time(lambda p=p: compiled(p, torch.bfloat16), graph=False)
        tbs = nbytes / t / 1e6
        name = scheme + (" " + ",".join(f"{a}={b}" for a, b in kw.items()) if kw else "")
        out.append(
            f"| {name} | {nbytes / 1e6:.0f} | {t:.1f} | {tbs:.2f} | "
            f"{100 * tbs / copy_tbs:.0f}% | {eager:.1f} | {comp:.1f} | {exact} |"
        )
        print(out[-1], flush=True)
    out.append(f"\n- copy bandwidth re-measured at the end: {copy_bandwidth():.2f} TB/s")
    text = "\n".join(out)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "dequant.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
