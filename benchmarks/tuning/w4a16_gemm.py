"""The packed 4-bit ``gemm`` path (``W x^T``: the decoded weight is the tensor cores' register
operand) at 64-4096 rows: a launch sweep against bf16 ``F.linear`` and the dispatcher's launch
(the packed GEMV to 32 rows, 64 for symmetric int4; this path from 33 to 64 rows for the
others; dequantize + cuBLAS beyond), with every launch checked against the float32 product.

Run on a CUDA GPU: ``python -m benchmarks.tuning.w4a16_gemm [--schemes int4,mxfp4] [--mid]``; prints
markdown and, when ``$OUT`` is set, writes it to ``$OUT/w4a16_gemm_<gpu>.md`` (``--mid``:
``$OUT/w4a16_mid_rows_<gpu>.md``).
"""

from __future__ import annotations

import argparse

from benchmarks._timing import (
    BENCHMARK_LAYERS,
    PACKED_4BIT_SCHEMES,
    header,
    launch_sweep,
    publish,
    select_schemes,
)
from qlens.kernels import LinearConfig

ROW_COUNTS = (64, 256, 1024, 4096)
# (activation rows, weight rows, K, warps, stages, K splits) per program.
LAUNCHES = (
    (128, 128, 64, 8, 3, 1),
    (128, 128, 128, 8, 3, 1),
    (256, 128, 64, 8, 3, 1),
    (128, 64, 128, 4, 4, 1),
    (64, 128, 128, 4, 3, 1),
    # more programs for the 4096-row layers at 64-256 rows
    (64, 64, 128, 4, 3, 1),
    (64, 64, 128, 4, 3, 4),
    (128, 128, 64, 8, 3, 4),
    # 256 weight rows a program: two warpgroups of 128-row wgmma tiles
    (128, 256, 64, 8, 3, 1),
)
CONFIGS = tuple(
    LinearConfig("gemm", bm, bn, bk, split_k=splits, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages, splits in LAUNCHES
)
# --mid: 33-64 rows, the 64-row GEMM tile at 1-8 K splits against the packed GEMV's 32-row
# programs (which run two row tiles here) and dequantize + cuBLAS.
MID_ROW_COUNTS = (40, 48, 64)
MID_SCHEMES = (*PACKED_4BIT_SCHEMES, ("int4", {"group_size": 128, "asymmetric": True}))
MID_CONFIGS = (
    *(
        LinearConfig("gemm", 64, 64, 128, split_k=s, num_warps=4, num_stages=3)
        for s in (1, 2, 4, 8)
    ),
    LinearConfig("gemm", 64, 128, 128, split_k=2, num_warps=4, num_stages=3),
    LinearConfig("gemv", 32, 64, 256, split_k=1, num_warps=4, num_stages=3),
    LinearConfig("gemv", 32, 64, 256, split_k=2, num_warps=4, num_stages=3),
    LinearConfig("dequant", 16, 16, 16),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", help="comma-separated subset of int4, mxfp4, nvfp4")
    parser.add_argument("--mid", action="store_true", help="33-64 rows against the other paths")
    args = parser.parse_args()
    schemes = select_schemes(MID_SCHEMES if args.mid else PACKED_4BIT_SCHEMES, args.schemes)
    if args.mid:
        rows = launch_sweep(BENCHMARK_LAYERS, MID_ROW_COUNTS, schemes, MID_CONFIGS)
        title, filename = "Packed 4-bit weights at 33-64 rows", "w4a16_mid_rows_h200.md"
    else:
        rows = launch_sweep(BENCHMARK_LAYERS, ROW_COUNTS, schemes, CONFIGS)
        title, filename = "Packed 4-bit GEMM path, weight as the left operand", "w4a16_gemm_h200.md"
    publish(header(title) + "\n".join(rows), filename)


if __name__ == "__main__":
    main()
