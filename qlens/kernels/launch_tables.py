"""The launch tables as data: each row and tuned constant names the measurement that chose it,
as ``file § section``, the file under ``benchmarks/`` (``§ top``: the file's first table).
docs/benchmarks.md ("Launch tables") gives the reasoning; ``qlens.kernels.configs`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Path = Literal["gemv", "splitk", "gemm", "dequant", "cublas"]
ANY_M = 1 << 62
FALLBACK = "fallback: not measured (GPUs other than the H200)"


@dataclass(frozen=True)
class TableRow:
    """Up to ``max_m`` rows take this launch (the first row that fits wins)."""

    max_m: int
    path: Path
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    evidence: str


@dataclass(frozen=True)
class Tuned:
    """A tuned constant and the measurement that chose it."""

    value: int
    evidence: str


# Rows handed to the packed GEMV on the H200, and symmetric int4's longer reach.
PACKED_GEMV_MAX_M = Tuned(
    32,
    "tuning/results/mid_rows_h200.md § top; tuning/results/mid_rows_h200.md § 2026-12-03 14:28 run",
)
INT4_PACKED_GEMV_MAX_M = Tuned(64, "tuning/results/mid_rows_h200.md § 2026-12-03 14:28 run")
# One-row packed GEMVs with at most this many programs per SM run two warps over longer K.
TWO_WARP_MAX_PROGRAMS_PER_SM = Tuned(
    8, "tuning/results/gemv_tiles_h200.md § top; tuning/results/quad_tiles_h100.md § top"
)
TWO_WARP_BLOCK_K = Tuned(
    2048, "tuning/results/gemv_tiles_h200.md § top; tuning/results/quad_tiles_h100.md § top"
)
# bitsandbytes' 4-bit codes (looked up in their table) take the packed GEMV up to this many rows;
# more rows decode the weight once and multiply with cuBLAS.
BNB4_PACKED_GEMV_MAX_M = Tuned(
    1,
    "results/bnb_nf4_linear_h100.md § 2026-12-07 16:58 UTC; "
    "results/bnb_nf4_linear_h100.md § 2026-12-07 17:09 UTC; "
    "results/bnb_nf4_linear_h100.md § 2026-12-08 00:22 UTC",
)
# One-row GEMVs split K at most this many ways: the split's reducing launch cost more host time
# than it saved, and unsplit narrow layers ran faster on the GPU too.
ONE_ROW_GEMV_MAX_SPLIT = Tuned(
    1,
    "tuning/results/narrow_rows_h200.md § top; tuning/results/one_row_split_e2e_h200.md § top",
)
# One-row byte-wise GEMVs with fewer 16-column tiles than SMs take tiles this many columns wide.
NARROW_BYTE_GEMV_BLOCK_N = Tuned(8, "tuning/results/narrow_rows_h200.md § top")
# K splits of the 33-64-row GEMM path on packed words.
MID_ROWS_GEMM_SPLIT = Tuned(
    4, "tuning/results/w4a16_gemm_h200.md § top; tuning/results/w4a16_mid_rows_h200.md § top"
)

# Weights in whole int32 words of packed 4-bit codes (word-wise GEMV, packed GEMM) on the H200.
H200_PACKED_WORDS: tuple[TableRow, ...] = (
    TableRow(1, "gemv", 16, 4, 1024, 1, 1, "tuning/results/quad_tiles_h100.md § top"),
    TableRow(16, "gemv", 16, 64, 256, 4, 3, "results/archive/dot_operand_order_h200.md § top"),
    TableRow(32, "gemv", 32, 64, 256, 4, 3, "tuning/results/mid_rows_h200.md § top"),
    TableRow(64, "gemm", 64, 64, 128, 4, 3, "tuning/results/w4a16_gemm_h200.md § top; tuning/results/w4a16_mid_rows_h200.md § top"),
    TableRow(ANY_M, "dequant", 16, 16, 16, 4, 3, "tuning/results/mid_rows_h200.md § 2026-12-03 14:28 run"),
)  # fmt: skip
# Other weight-only weights on the H200.
H200_WEIGHT_ONLY: tuple[TableRow, ...] = (
    TableRow(
        1,
        "gemv",
        16,
        16,
        512,
        4,
        4,
        "tuning/results/pipelining_h200.md § One-row GEMV, us per call",
    ),
    TableRow(32, "splitk", 16, 128, 128, 4, 3, "tuning/results/few_rows_h200.md § Run 2"),
    TableRow(
        ANY_M, "dequant", 16, 16, 16, 4, 3, "results/kernels_h200.md § Time (us) and speed-up"
    ),
)
# W8A8 (fp8-block weights and activations) on the H200.
H200_W8A8: tuple[TableRow, ...] = (
    TableRow(16, "splitk", 16, 64, 128, 4, 4, "results/kernels_sweep_h200.md § Launch sweep"),
    TableRow(
        ANY_M, "cublas", 128, 128, 128, 8, 3, "results/kernels_h200.md § Time (us) and speed-up"
    ),
)
# Other GPUs: the GEMVs' K loops unpipelined.
DEFAULT_WEIGHT_ONLY: tuple[TableRow, ...] = (
    TableRow(1, "gemv", 16, 64, 128, 4, 1, FALLBACK),
    TableRow(32, "splitk", 16, 64, 64, 4, 3, FALLBACK),
    TableRow(ANY_M, "dequant", 16, 16, 16, 4, 3, FALLBACK),
)
DEFAULT_W8A8: tuple[TableRow, ...] = (
    TableRow(64, "splitk", 64, 64, 128, 4, 3, FALLBACK),
    TableRow(ANY_M, "gemm", 128, 128, 128, 8, 3, FALLBACK),
)

TABLES = {
    "H200_PACKED_WORDS": H200_PACKED_WORDS,
    "H200_WEIGHT_ONLY": H200_WEIGHT_ONLY,
    "H200_W8A8": H200_W8A8,
    "DEFAULT_WEIGHT_ONLY": DEFAULT_WEIGHT_ONLY,
    "DEFAULT_W8A8": DEFAULT_W8A8,
}
TUNED = {
    "PACKED_GEMV_MAX_M": PACKED_GEMV_MAX_M,
    "INT4_PACKED_GEMV_MAX_M": INT4_PACKED_GEMV_MAX_M,
    "TWO_WARP_MAX_PROGRAMS_PER_SM": TWO_WARP_MAX_PROGRAMS_PER_SM,
    "TWO_WARP_BLOCK_K": TWO_WARP_BLOCK_K,
    "MID_ROWS_GEMM_SPLIT": MID_ROWS_GEMM_SPLIT,
    "ONE_ROW_GEMV_MAX_SPLIT": ONE_ROW_GEMV_MAX_SPLIT,
    "NARROW_BYTE_GEMV_BLOCK_N": NARROW_BYTE_GEMV_BLOCK_N,
    "BNB4_PACKED_GEMV_MAX_M": BNB4_PACKED_GEMV_MAX_M,
}
