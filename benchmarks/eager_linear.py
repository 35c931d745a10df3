"""Host time of eager QuantLinear calls (one row, or ``--rows``) against bf16 ``F.linear``.

For each layer and scheme: the host microseconds per call of back-to-back calls without a
sync (``time.perf_counter`` around the calls only), and the wall microseconds per call once
the GPU has finished them too; with the direct Triton launches (``FastLaunch``) and with
every launch through ``JITFunction.run`` (``FastLaunch.direct = False``).

Run on a CUDA GPU: ``python benchmarks/eager_linear.py [--rows 1,32,256]``; prints markdown
and, when ``$OUT`` is set, writes it to ``$OUT/eager_linear_<gpu>.md``. Prefill row counts take
the dequantize path (decode, then cuBLAS) from the launch tables' threshold on.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import header, host_and_wall_us, publish, seeded_weight

from qlens.kernels.fast_launch import FastLaunch
from qlens.modules import QuantLinear
from qlens.quant.quantize import quantize_weight

LAYERS = ((4096, 4096), (14336, 4096))
SCHEMES = (
    ("int4", {"group_size": 128}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("fp8-block", {}),
    ("int8", {}),
)
CALLS = 500
TIMING = (
    f"median of five rounds of {CALLS} back-to-back calls after 50 warm-up calls; host: "
    "perf_counter around the calls without a sync; wall: until a sync after them returns"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1", help="comma-separated row counts, default 1")
    counts = [int(m) for m in parser.parse_args().rows.split(",")]
    rows = [
        "| N x K | rows | scheme | host us a call | wall us a call | host us, normal launch | "
        "wall us, normal launch | host vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (n, k), m in ((layer, m) for layer in LAYERS for m in counts):
        w = seeded_weight(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16_host, bf16_wall = host_and_wall_us(lambda w=w, x=x: F.linear(x, w))
        rows.append(
            f"| {n} x {k} | {m} | bf16 F.linear | {bf16_host:.1f} | {bf16_wall:.1f} | | | 1.00 |"
        )
        print(rows[-1], flush=True)
        for scheme, options in SCHEMES:
            module = QuantLinear(quantize_weight(w, scheme, **options)).cuda()
            host, wall = host_and_wall_us(lambda module=module, x=x: module(x))
            FastLaunch.direct = False
            try:
                slow_host, slow_wall = host_and_wall_us(lambda module=module, x=x: module(x))
            finally:
                FastLaunch.direct = True
            rows.append(
                f"| {n} x {k} | {m} | {scheme} | {host:.1f} | {wall:.1f} | {slow_host:.1f} | "
                f"{slow_wall:.1f} | {host / bf16_host:.2f} |"
            )
            print(rows[-1], flush=True)
        del w
    text = header("Eager QuantLinear calls: host time against bf16", TIMING)
    publish(text + "\n".join(rows), "eager_linear_h200.md")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
