"""The packed 4-bit tensor-core GEMV at 16 and 4 rows: tiles, warps, pipelining depth and K splits on
the 8B decode layers and the largest benchmark layer, against the dispatcher's choice.

Run on a CUDA GPU: ``python -m benchmarks.tuning.dot_gemv_tiles``; prints markdown and, when ``$OUT``
is set, writes it to ``$OUT/dot_gemv_tiles_<gpu>.md``.
"""

from __future__ import annotations

from benchmarks._timing import (
    DECODE_LAYERS_8B,
    PACKED_4BIT_SCHEMES,
    header,
    launch_sweep,
    publish,
)
from qlens.kernels import LinearConfig

ROW_COUNTS = (16, 4)
SHAPES = (*DECODE_LAYERS_8B, (28672, 8192))
# (BLOCK_N, BLOCK_K, warps, stages, K splits)
LAUNCHES = (
    (64, 256, 4, 3, 1),
    (64, 256, 4, 3, 2),
    (64, 256, 4, 3, 4),
    (32, 512, 4, 3, 1),
    (32, 512, 4, 3, 2),
    (32, 512, 4, 3, 4),
    (32, 256, 4, 3, 2),
)
CONFIGS = tuple(
    LinearConfig("gemv", 16, bn, bk, split, num_warps=warps, num_stages=stages)
    for bn, bk, warps, stages, split in LAUNCHES
)


def main() -> None:
    rows = launch_sweep(SHAPES, ROW_COUNTS, PACKED_4BIT_SCHEMES, CONFIGS)
    publish(header("Packed tensor-core GEMV at 16 and 4 rows") + "\n".join(rows),
            "dot_gemv_tiles_h200.md")  # fmt: skip


if __name__ == "__main__":
    main()
