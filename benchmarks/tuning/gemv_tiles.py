"""One-row word-wise GEMV tiles on the 8B decode layers and the largest benchmark layer: rows per
program, K per loop step, warps and pipelining depth, against the dispatcher's launch. Every
launch reads ``x`` as it is (the eager path).

Run on a CUDA GPU: ``python -m benchmarks.tuning.gemv_tiles [--schemes mxfp4,nvfp4]
[--launches 8x1024w1st3,4x2048w2st1]``; prints markdown and, when ``$OUT`` is set, writes it to
``$OUT/gemv_tiles_<gpu>.md``.
"""

from __future__ import annotations

import argparse

from benchmarks._timing import (
    DECODE_LAYERS_8B,
    PACKED_4BIT_SCHEMES,
    header,
    launch_sweep,
    publish,
    select_schemes,
)
from qlens.kernels import LinearConfig

SHAPES = (*DECODE_LAYERS_8B, (28672, 8192))
# (BLOCK_N, BLOCK_K, warps, stages). Rows read as they are run on quad tiles, whose pipelined
# launches ran 2-3x slower than unpipelined ones on the H100 (tuning/results/quad_tiles_h100.md):
# the sweep is of unpipelined tiles, with one pipelined launch for reference.
LAUNCHES = (
    (4, 1024, 1, 1),
    (4, 2048, 1, 1),
    (4, 2048, 2, 1),
    (4, 4096, 4, 1),
    (4, 512, 1, 1),
    (8, 1024, 1, 1),
    (8, 2048, 2, 1),
    (8, 4096, 4, 1),
    (16, 512, 2, 1),
    (16, 1024, 2, 1),
    (32, 256, 4, 1),
    (64, 128, 4, 1),
    (8, 1024, 1, 3),
)


def one_row_launch(block_n: int, block_k: int, warps: int, stages: int) -> LinearConfig:
    """The one-row GEMV launch of these tiles, warps and pipelining depth."""
    return LinearConfig("gemv", 16, block_n, block_k, num_warps=warps, num_stages=stages)


CONFIGS = tuple(one_row_launch(*launch) for launch in LAUNCHES)


def chosen_launches(spec: str | None) -> tuple[LinearConfig, ...]:
    """The launches ``spec`` names (``"8x1024w1st3,4x2048w2st1"``: rows, K, warps, stages), or
    every launch of ``LAUNCHES`` without one."""
    if not spec:
        return CONFIGS
    configs = []
    for item in spec.split(","):
        rows_k, rest = item.split("w")
        warps, stages = rest.split("st")
        bn, bk = rows_k.split("x")
        configs.append(one_row_launch(int(bn), int(bk), int(warps), int(stages)))
    return tuple(configs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemes", help="comma-separated packed 4-bit schemes; default all")
    parser.add_argument(
        "--launches", help="comma-separated launches, as 8x1024w1st3 (rows, K, warps, stages)"
    )
    args = parser.parse_args()
    schemes = select_schemes(PACKED_4BIT_SCHEMES, args.schemes)
    rows = launch_sweep(SHAPES, (1,), schemes, chosen_launches(args.launches))
    publish(header("One-row word-wise GEMV tiles") + "\n".join(rows), "gemv_tiles_h200.md")


if __name__ == "__main__":
    main()
