"""Python (host) time of one eager quantized-linear call, kernel launches excluded.

Runs on the CPU in Triton's interpreter with every Triton launch of the GEMVs replaced by a
no-op, so what is timed is qlens' own dispatch: checks, configuration, the activation
regrouping and argument building. Eager decode on a GPU pays this on every call.

Run: ``TRITON_INTERPRET=1 python benchmarks/host_time.py``; prints markdown and, when ``$OUT``
is set, writes it to ``$OUT/host_time_cpu.md``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import torch
from _timing import publish

import qlens.kernels.gemv as gemv
from qlens.kernels import experts_linear, quantized_linear
from qlens.kernels.fast_launch import FastLaunch
from qlens.quant.quantize import quantize_weight

CALLS = 2000


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: None


def _us_per_call(call) -> float:
    """Median over five rounds of the mean microseconds per call."""
    for _ in range(50):
        call()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        rounds.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(rounds)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: the calls run on CPU tensors")
    torch.manual_seed(0)
    gemv.PACKED_GEMV = FastLaunch(_NoLaunch())
    gemv._GEMV = FastLaunch(_NoLaunch())
    int4 = quantize_weight(torch.randn(4096, 4096), "int4", group_size=128)
    fp8 = quantize_weight(torch.randn(4096, 4096), "fp8-block")
    experts = quantize_weight(torch.randn(8, 512, 1024), "int4", group_size=128)
    x, xe, ids = torch.randn(1, 4096), torch.randn(2, 1024), torch.tensor([1, 5])
    cases = {
        "quantized_linear, int4 4096 x 4096, one row": lambda: quantized_linear(x, int4),
        "quantized_linear, fp8-block 4096 x 4096, one row": lambda: quantized_linear(x, fp8),
        "experts_linear, int4 8 x 512 x 1024, two routed rows": lambda: experts_linear(
            xe, experts, ids, ids_in_range=True
        ),
    }
    lines = [
        "# Host time per eager call, Triton launches excluded",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- command: `TRITON_INTERPRET=1 python {' '.join(sys.argv)}`",
        f"- timing: median of five rounds of {CALLS} calls each, after 50 warm-up calls",
        "",
        "| call | us of Python per call |",
        "|---|---|",
    ]
    for name, call in cases.items():
        lines.append(f"| {name} | {_us_per_call(call):.1f} |")
        print(lines[-1], flush=True)
    publish("\n".join(lines), "host_time_cpu.md")


if __name__ == "__main__":
    main()
