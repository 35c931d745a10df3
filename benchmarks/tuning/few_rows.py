"""The dispatcher's default launch for 2 to 8 rows (small-batch decode, speculative decoding)
against bf16 ``F.linear``, on the 8B decode layers and the largest benchmark layer, for every
weight-only scheme the kernels read.

Run on a CUDA GPU: ``python -m benchmarks.tuning.few_rows``; prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/few_rows_<gpu>.md``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks._timing import (
    DECODE_LAYERS_8B,
    header,
    launch_label,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    select_schemes,
    time_bf16_linear,
    time_linear,
)
from qlens.kernels import dequantize_triton, quantized_linear
from qlens.kernels.dispatch import default_config
from qlens.quant.quantize import quantize_weight

SHAPES = (*DECODE_LAYERS_8B, (28672, 8192))
SCHEMES = (
    ("int4", {"group_size": 128}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("fp8-block", {}),
    ("int8", {"group_size": 128}),
)
ROWS = (2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", help="comma-separated subset of the schemes")
    parser.add_argument("--rows", help="comma-separated row counts (default 2,4,8)")
    args = parser.parse_args()
    schemes = select_schemes(SCHEMES, args.schemes)
    row_counts = ROWS if args.rows is None else tuple(int(r) for r in args.rows.split(","))
    dev = torch.device("cuda")
    rows = [
        "| N x K | scheme | M | launch | bf16 us | qlens us | vs bf16 | rel. err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, k in SHAPES:
        w = seeded_weight(n, k, dev)
        bf16 = rotation(w)
        for m in row_counts:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = time_bf16_linear(bf16, x)
            for scheme, kw in schemes:
                p0 = quantize_weight(w, scheme, **kw)
                ps = rotation(p0)
                cfg = default_config(p0, m, dev)
                t = time_linear(ps, x)
                exact = F.linear(x.double(), dequantize_triton(p0, torch.float32).double())
                err = rel_err(quantized_linear(x, p0), exact)
                rows.append(
                    f"| {n} x {k} | {scheme} | {m} | {launch_label(cfg)} | {t_bf16:.1f} | {t:.1f} | "
                    f"{t_bf16 / t:.2f}x | {err:.1e} |"
                )
                print(rows[-1], flush=True)
                del ps
        del bf16
        torch.cuda.empty_cache()
    publish(header("Default launches for 2 to 8 rows") + "\n".join(rows), "few_rows_h200.md")


if __name__ == "__main__":
    main()
