"""Launch configurations: a small table tuned on the H200 for every Hopper GPU (H100, H200,
GH200, H800, H20 share its SM; the splits and per-SM rules follow each GPU's SM count), safe
defaults elsewhere.

``"gemv"`` streams the weight once for a few rows: one row in plain FMAs, and for packed 4-bit
words up to 32 rows (int4: 64) on tensor-core dots (``qlens.kernels.gemv``); the decode path
(``"splitk"``) runs small M on tensor cores with narrow tiles and splits K over programs so a
single token still fills the GPU; the ``"gemm"`` path runs more rows over wider tensor-core tiles
(on the H200, packed MXFP4 and NVFP4 words from 33 to 64 rows).
``"dequant"`` decodes the weight once with a Triton kernel and multiplies with cuBLAS;
``"cublas"`` (W8A8 only) quantizes activations with the Triton kernel and runs cuBLAS' blockwise
FP8 GEMM when the shape allows it, else the Triton GEMM.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import torch

from qlens.kernels import launch_tables
from qlens.kernels.launch_tables import Path, TableRow
from qlens.kernels.runtime import cuda_index, gpu_name, interpreting
from qlens.quant.codecs.checks import ceil_div


def require_tile_sizes(minimum: int = 16, **sizes: int) -> None:
    """Raise unless every tile size is a power of two (``tl.arange``) of at least ``minimum``
    (16 wherever the tile may meet a tensor-core dot)."""
    for name, value in sizes.items():
        if value < minimum or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


@dataclass(frozen=True)
class LinearConfig:
    """Tile sizes and launch parameters of one quantized linear launch.

    ``num_stages`` is the software-pipelining depth of the K loop's loads (1: none); the FMA
    GEMVs honour it too, the word-wise one for a single row only. ``words``: packed 4-bit
    weights in whole int32 words take the word-wise GEMV on the ``"gemv"`` path (``False``
    runs the byte-wise kernel instead, for comparisons). ``x_as_is``: how that GEMV's rows on
    tensor cores (2-64) read ``x``: ``True``, as the caller holds it, split by code position in
    registers (one launch a call); ``False``, regrouped by a copy before the launch (faster on
    the GPU, one more launch on the host); ``None`` (the default), as it is outside CUDA-graph
    capture and regrouped while a graph captures (``benchmarks/tuning/results/
    few_rows_as_is_h100.md``). ``split_sum``: whether that GEMV's tensor-core launches split
    along K sum their partials in the kernel, the last program of each tile (one launch a
    call), or leave them to a second, reducing launch; ``None`` (the default): summed in the
    launch on rows as they are (eager calls, bound by host time), reduced after the regrouped
    one (CUDA graphs, bound by GPU time) (``benchmarks/tuning/results/few_rows_split_sum_h100.md``)."""

    path: Path
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    words: bool = True
    x_as_is: bool | None = None
    split_sum: bool | None = None

    def __post_init__(self) -> None:
        require_tile_sizes(block_m=self.block_m, block_k=self.block_k)
        # The FMA GEMV also runs narrow column tiles; dots (more rows) check their own.
        require_tile_sizes(4 if self.path == "gemv" else 16, block_n=self.block_n)
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


# Interpreter and fallback thresholds: up to GEMV_MAX_M rows take the GEMV, up to SPLITK_MAX_M
# the tensor-core decode path, more rows the GEMM.
GEMV_MAX_M = 4
SPLITK_MAX_M = 64
GEMV_MAX_SPLIT = 4
# The H200 tables and their tuned constants, each with its evidence (launch_tables.py).
PACKED_GEMV_MAX_M = launch_tables.PACKED_GEMV_MAX_M.value
INT4_PACKED_GEMV_MAX_M = launch_tables.INT4_PACKED_GEMV_MAX_M.value
MID_ROWS_GEMM_SPLIT = launch_tables.MID_ROWS_GEMM_SPLIT.value
ONE_ROW_GEMV_MAX_SPLIT = launch_tables.ONE_ROW_GEMV_MAX_SPLIT.value
BNB4_PACKED_GEMV_MAX_M = launch_tables.BNB4_PACKED_GEMV_MAX_M.value
# Table-indexed codes past BNB4_PACKED_GEMV_MAX_M rows: decoded once (tiles of the dequantize
# kernel's default), then cuBLAS.
DECODED_ROWS_CONFIG = LinearConfig("dequant", 16, 16, 16)


def next_pow2(x: int) -> int:
    """The smallest power of two at least ``x`` (1 for ``x <= 1``)."""
    return 1 << max(x - 1, 0).bit_length()


def sm_count(device: torch.device) -> int:
    """The SMs of ``device``'s GPU (1 elsewhere)."""
    if device.type == "cuda":
        return _cuda_sm_count(cuda_index(device))
    return 1


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_k_for(m: int, n: int, k: int, cfg: LinearConfig, sms: int) -> int:
    """K splits for a grid on a GPU of ``sms`` SMs: doubled while the grid has fewer than about
    two programs per SM (tensor-core split-K), four (a GEMV of several rows) or one more than the
    SMs (a GEMV of 32-row programs), keeping >= 4 K-steps per split (>= 1 on the GEMV path) and
    at most ``GEMV_MAX_SPLIT`` splits of a GEMV. A one-row GEMV splits at most
    ``ONE_ROW_GEMV_MAX_SPLIT`` ways. docs/benchmarks.md ("Launch tables") gives the evidence.
    """
    if cfg.path == "gemv" and m == 1:
        most = ONE_ROW_GEMV_MAX_SPLIT
        wanted = sms
    elif cfg.path == "gemv":
        most = GEMV_MAX_SPLIT
        wanted = sms + 1 if cfg.block_m > 16 else 4 * sms
    else:
        most = ceil_div(k, cfg.block_k)
        wanted = 2 * sms
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    k_steps = ceil_div(k, cfg.block_k)
    min_steps = 1 if cfg.path == "gemv" else 4
    split = 1
    while tiles * split < wanted and k_steps // (split * 2) >= min_steps and split * 2 <= most:
        split *= 2
    return split


def interpreter_config(m: int, n: int, k: int, path: Path | None = None) -> LinearConfig:
    """Few, large programs: the interpreter pays per program instance and K-step."""
    if path is None:
        path = "gemv" if m <= GEMV_MAX_M else "splitk" if m <= SPLITK_MAX_M else "gemm"
    return LinearConfig(
        path=path,
        block_m=max(16, min(64, next_pow2(m))),
        block_n=max(16, min(64, next_pow2(n))),
        block_k=128,
    )


def choose_config(
    m: int,
    n: int,
    k: int,
    device: torch.device,
    *,
    w8a8: bool = False,
    packed_words: bool = False,
    int4: bool = False,
    table_codes: bool = False,
) -> LinearConfig:
    """The launch for an ``[m, k] x [n, k]^T`` product on ``device`` (weight-only or W8A8).

    ``packed_words``: the weight takes the word-wise GEMV (``qlens.kernels.gemv.word_view``);
    ``int4``: its words hold symmetric int4 codes, which take the packed GEMV up to more rows;
    ``table_codes``: its codes index a table (bitsandbytes), which takes the packed GEMV up to
    ``BNB4_PACKED_GEMV_MAX_M`` rows only and beyond decodes the weight once for cuBLAS.
    Choices are kept per shape and device (an eager call pays a dictionary lookup, not the table
    walk: on the H200 host the walk took about 60 us a call). W8A8's single row takes the
    weight-only GEMV, which reads it rounded to FP8 (one launch, no quantizing one).
    """
    if w8a8 and m == 1:
        w8a8 = False
    if table_codes and m > BNB4_PACKED_GEMV_MAX_M:
        return DECODED_ROWS_CONFIG
    if interpreting():
        gemv_less = w8a8 and m <= SPLITK_MAX_M  # W8A8 has no GEMV: its decode path is split-K
        return interpreter_config(m, n, k, "splitk" if gemv_less else None)
    return _table_config(m, n, k, gpu_name(device), sm_count(device), w8a8, packed_words, int4)


HOPPER_NAME = re.compile(r"\bG?H(100|200|800|20)\b")


def hopper(name: str) -> bool:
    """Whether a GPU of this name is a Hopper one, which takes the tables tuned on the H200."""
    return HOPPER_NAME.search(name) is not None


@functools.lru_cache(maxsize=4096)
def _table_config(
    m: int,
    n: int,
    k: int,
    name: str,
    sms: int,
    w8a8: bool,
    packed_words: bool,
    int4: bool,
) -> LinearConfig:
    """``choose_config`` on a GPU called ``name`` with ``sms`` SMs."""
    tuned = hopper(name)  # the tables tuned on the H200
    table: tuple[TableRow, ...]
    if w8a8:
        table = launch_tables.H200_W8A8 if tuned else launch_tables.DEFAULT_W8A8
    elif packed_words and tuned:
        table = launch_tables.H200_PACKED_WORDS
    else:
        table = launch_tables.H200_WEIGHT_ONLY if tuned else launch_tables.DEFAULT_WEIGHT_ONLY
    table_m = m
    if packed_words and tuned and int4 and m <= INT4_PACKED_GEMV_MAX_M:
        table_m = min(m, PACKED_GEMV_MAX_M)
    row = next(row for row in table if table_m <= row.max_m)
    cfg = LinearConfig(
        row.path,
        row.block_m,
        row.block_n,
        row.block_k,
        num_warps=row.num_warps,
        num_stages=row.num_stages,
    )
    narrow = ceil_div(n, cfg.block_n) < sms
    if tuned and m == 1 and not packed_words and cfg.path == "gemv" and narrow:
        cfg = replace(cfg, block_n=launch_tables.NARROW_BYTE_GEMV_BLOCK_N.value)
    if packed_words and tuned and m == 1:
        if ceil_div(n, cfg.block_n) <= launch_tables.TWO_WARP_MAX_PROGRAMS_PER_SM.value * sms:
            cfg = replace(cfg, block_k=launch_tables.TWO_WARP_BLOCK_K.value, num_warps=2)
    if cfg.path in ("splitk", "gemv"):
        cfg = replace(cfg, split_k=split_k_for(m, n, k, cfg, sms))
    elif cfg.path == "gemm" and table is launch_tables.H200_PACKED_WORDS:
        # Four K splits, each of at least four K steps.
        steps = ceil_div(k, cfg.block_k)
        cfg = replace(cfg, split_k=max(1, min(MID_ROWS_GEMM_SPLIT, steps // 4)))
    return cfg
