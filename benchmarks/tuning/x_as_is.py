"""One-row packed 4-bit GEMV reading ``x`` as it is against regrouping it first, on the 8B
decode layers: graph-timed (weights streamed from memory; the regrouped variant's graph holds
its ``permute_codes`` launch) and eager (wall time per call of back-to-back calls, one sync at
the end, host work included).

Run on a CUDA GPU from the repository root:
``python -m benchmarks.tuning.x_as_is``; prints markdown and, when ``$OUT`` is set, writes it to
``$OUT/x_as_is_<gpu>.md``.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from benchmarks._timing import (
    DECODE_LAYERS_8B,
    PACKED_4BIT_SCHEMES,
    header,
    publish,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_graph,
)
from qlens.kernels import linear
from qlens.quant.quantize import quantize_weight

EAGER_CALLS = 500


def eager_us(call) -> float:
    """Median wall microseconds a call over five rounds of back-to-back calls."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(EAGER_CALLS):
            call()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / EAGER_CALLS * 1e6)
    return statistics.median(rounds)


def main() -> None:
    dev = torch.device("cuda")
    lines = [
        header("One-row packed GEMV: x as it is against x regrouped"),
        "",
        "| N x K | scheme | graph us, as is | graph us, regrouped | bf16 graph us | "
        "eager us, as is | eager us, regrouped |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, k in DECODE_LAYERS_8B:
        w = seeded_weight(n, k, dev)
        bf16 = time_bf16_linear(rotation(w), torch.randn(1, k, device=dev, dtype=torch.bfloat16))
        for scheme, options in PACKED_4BIT_SCHEMES:
            payloads = rotation(quantize_weight(w, scheme, **options))
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            cells = {}
            for as_is in (True, False):
                calls = [functools.partial(linear, x, p, x_as_is=as_is) for p in payloads]
                cells[as_is] = (time_graph(calls), eager_us(calls[0]))
            (g1, e1), (g0, e0) = cells[True], cells[False]
            lines.append(
                f"| {n} x {k} | {scheme} | {g1:.1f} | {g0:.1f} | {bf16:.1f} | {e1:.1f} | {e0:.1f} |"
            )
            print(lines[-1], flush=True)
        del w
        torch.cuda.empty_cache()
    publish("\n".join(lines), "x_as_is_h200.md")


if __name__ == "__main__":
    main()
