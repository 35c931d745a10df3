"""The packed 4-bit tensor-core GEMV at 24-64 rows: 32 rows a program (one program streams its
weight tile once for all of them) over 64- and 32-column tiles, unsplit and with K split 2 and
4 ways, against bf16 ``F.linear`` and the dispatcher's launch. (Its 14:28 run on 2026-12-03
compared 32-256 rows and 32-128 rows a program against the split-K kernel and dequantize +
cuBLAS; ``mid_rows_h200.md`` keeps that table.)

Run on a CUDA GPU: ``python -m benchmarks.tuning.mid_rows``; prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/mid_rows_<gpu>.md``.
"""

from __future__ import annotations

from benchmarks._timing import (
    BENCHMARK_LAYERS,
    PACKED_4BIT_SCHEMES,
    header,
    launch_sweep,
    publish,
)
from qlens.kernels import LinearConfig

ROW_COUNTS = (24, 32, 48, 64)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, K splits)
LAUNCHES = (
    (32, 64, 256, 4, 3, 1),
    (32, 64, 256, 4, 3, 2),
    (32, 64, 256, 4, 3, 4),
    (32, 32, 256, 4, 3, 1),
    (32, 32, 256, 4, 3, 2),
    (16, 64, 256, 4, 3, 2),
)
CONFIGS = tuple(
    LinearConfig("gemv", bm, bn, bk, split_k=splits, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages, splits in LAUNCHES
)


def main() -> None:
    rows = launch_sweep(BENCHMARK_LAYERS, ROW_COUNTS, PACKED_4BIT_SCHEMES, CONFIGS)
    publish(header("Packed tensor-core GEMV at 24-64 rows") + "\n".join(rows),
            "mid_rows_h200.md")  # fmt: skip


if __name__ == "__main__":
    main()
