"""The packed 4-bit tensor-core GEMV at 32-256 rows: rows per program (one program streams its
weight tile once for all of them), tile and warps, against bf16 ``F.linear`` and the
dispatcher's launch (up to 2026-12-03 14:28 the split-K kernel to 32 rows, dequantize + cuBLAS
beyond).

Run on a CUDA GPU: ``python benchmarks/mid_rows.py``; prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/mid_rows_h200.md``.
"""

from __future__ import annotations

from qlens.kernels import LinearConfig
from qlens.kernels.timing import header, launch_sweep, publish

ROW_COUNTS = (32, 64, 128, 256)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}), ("nvfp4", {}))
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
LAUNCHES = (
    (32, 64, 256, 4, 3),
    (64, 64, 256, 4, 3),
    (64, 64, 128, 4, 3),
    (64, 128, 128, 8, 3),
    (128, 64, 128, 8, 3),
)
CONFIGS = tuple(
    LinearConfig("gemv", bm, bn, bk, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages in LAUNCHES
)


def main() -> None:
    rows = launch_sweep(SHAPES, ROW_COUNTS, SCHEMES, CONFIGS)
    publish(header("Packed tensor-core GEMV at 32-256 rows") + "\n".join(rows),
            "mid_rows_h200.md")  # fmt: skip


if __name__ == "__main__":
    main()
