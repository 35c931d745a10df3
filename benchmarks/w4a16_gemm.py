"""The packed 4-bit ``gemm`` path (``W x^T``: the decoded weight is the tensor cores' register
operand) at 64-4096 rows: a launch sweep against bf16 ``F.linear`` and the dispatcher's launch
(dequantize + cuBLAS from 33 rows, int4's packed GEMV to 64), with every launch checked against
the float32 product.

Run on a CUDA GPU: ``python benchmarks/w4a16_gemm.py [--schemes int4,mxfp4]``; prints markdown
and, when ``$OUT`` is set, writes it to ``$OUT/w4a16_gemm_h200.md``.
"""

from __future__ import annotations

import argparse

from qlens.kernels import LinearConfig
from qlens.kernels.timing import header, launch_sweep, publish

ROW_COUNTS = (64, 256, 1024, 4096)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", help="comma-separated subset of int4, mxfp4, nvfp4")
    args = parser.parse_args()
    schemes = [c for c in SCHEMES if args.schemes is None or c[0] in args.schemes.split(",")]
    rows = launch_sweep(SHAPES, ROW_COUNTS, schemes, CONFIGS)
    publish(header("Packed 4-bit GEMM path, weight as the left operand") + "\n".join(rows),
            "w4a16_gemm_h200.md")  # fmt: skip


if __name__ == "__main__":
    main()
