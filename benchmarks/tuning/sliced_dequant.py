"""Prefill through dequantize + cuBLAS, whole weight against bands of rows that stay in L2.

The prefill route of a packed weight decodes it to bf16 and runs cuBLAS; the decoded weight is
written to memory and read back, 2.5x the bytes bf16's own GEMM reads. Decoding a band of rows
into one reused buffer small enough for L2, then multiplying that band into its columns of the
output, may keep those writes in L2. This times, at 2048 tokens on the 8B layers: bf16
``F.linear``, the whole-weight route, and bands of several sizes, each over weights rotated past
L2, and checks the banded output equals the whole-weight output bit for bit.

Run on a CUDA GPU: ``python -m benchmarks.tuning.sliced_dequant [--schemes int4,nvfp4]``;
prints markdown and, when ``$OUT`` is set, writes it to ``$OUT/sliced_dequant_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
import torch.nn.functional as F

from benchmarks._timing import (
    PACKED_4BIT_SCHEMES,
    header,
    publish,
    rotation,
    seeded_weight,
    select_schemes,
    time_graph,
)
from qlens.kernels.dequant import dequantize_view
from qlens.kernels.layout_view import KernelWeight
from qlens.kernels.weights import kernel_weight
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.quantize import quantize_weight

TOKENS = 2048
# The 8B decoder layer's linears (N, K) and how many of each it has.
LAYER_8B = (((4096, 4096), 2), ((1024, 4096), 2), ((14336, 4096), 2), ((4096, 14336), 1))
BAND_MB = (8, 16, 24, 32)


def row_band(w: KernelWeight, first: int, last: int) -> KernelWeight:
    """Rows ``[first, last)`` of ``w`` (``first`` a multiple of its scale rows)."""
    lo, hi = first // w.group_n, ceil_div(last, w.group_n)
    return dataclasses.replace(
        w,
        n=last - first,
        data=w.data[first:last],
        scales=w.scales[lo:hi],
        zeros=None if w.zeros is None else w.zeros[lo:hi],
    )


def band_rows(w: KernelWeight, megabytes: int) -> int:
    """Rows of a band whose bf16 decode takes about ``megabytes``, a multiple of 128."""
    return max(128, (megabytes << 20) // (2 * w.k) // 128 * 128)


def whole(x: torch.Tensor, w: KernelWeight) -> torch.Tensor:
    return F.linear(x, dequantize_view(w, x.dtype))


def banded(x: torch.Tensor, w: KernelWeight, rows: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    buf = torch.empty((min(rows, w.n), w.k), dtype=x.dtype, device=x.device)
    for first in range(0, w.n, rows):
        last = min(first + rows, w.n)
        band = dequantize_view(row_band(w, first, last), x.dtype, out=buf[: last - first])
        torch.mm(x, band.t(), out=out[:, first:last])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="int4,nvfp4,mxfp4")
    args = parser.parse_args()
    lines = [
        header("Prefill dequantize + cuBLAS: whole weight against L2-sized bands"),
        f"{TOKENS} tokens, bf16 activations; us per call; last row: one 8B decoder layer's "
        "seven linears (q, k, v, o, gate, up, down).",
        "",
        "| scheme | N x K | bf16 us | whole us | "
        + " | ".join(f"band {mb} MB us" for mb in BAND_MB)
        + " | best band / whole | whole / bf16 | best band / bf16 | exact |",
        "|---" * (8 + len(BAND_MB)) + "|",
    ]
    print("\n".join(lines), flush=True)
    x = torch.randn(TOKENS, 4096, device="cuda", dtype=torch.bfloat16)
    for scheme, options in select_schemes(PACKED_4BIT_SCHEMES, args.schemes):
        totals = [0.0] * (2 + len(BAND_MB))
        for (n, k), count in LAYER_8B:
            xk = x if k == 4096 else torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
            dense = seeded_weight(n, k)
            payloads = rotation(quantize_weight(dense, scheme, **options))
            views = [kernel_weight(p) for p in payloads]
            times = [time_graph([functools.partial(F.linear, xk, d) for d in rotation(dense)])]
            times.append(time_graph([functools.partial(whole, xk, v) for v in views]))
            for mb in BAND_MB:
                rows = band_rows(views[0], mb)
                times.append(time_graph([functools.partial(banded, xk, v, rows) for v in views]))
            exact = all(
                torch.equal(banded(xk, views[0], band_rows(views[0], mb)), whole(xk, views[0]))
                for mb in BAND_MB
            )
            totals = [t + count * s for t, s in zip(totals, times, strict=True)]
            lines.append(_row(scheme, f"{n} x {k}", times, str(exact)))
            print(lines[-1], flush=True)
            del payloads, views, dense
        lines.append(_row(scheme, "8B layer", totals, ""))
        print(lines[-1], flush=True)
    publish("\n".join(lines), "sliced_dequant.md")


def _row(scheme: str, shape: str, times: list[float], exact: str) -> str:
    bf16, full, *bands = times
    best = min(bands)
    cells = " | ".join(f"{t:.1f}" for t in times)
    return (
        f"| {scheme} | {shape} | {cells} | {best / full:.3f} | {full / bf16:.3f} | "
        f"{best / bf16:.3f} | {exact} |"
    )


if __name__ == "__main__":
    main()
