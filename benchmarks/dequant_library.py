"""Dequantize kernels of the library layouts (bitsandbytes NF4 flat and nested, LLM.int8, GGUF
Q4_0-Q8_0, BitNet) on random payloads of a 28672 x 8192 weight, against eager torch and
``torch.compile`` of the codec, as a share of the same-run copy ceiling (packed bytes read plus
bf16 bytes written). ``--sweep`` also times every tile of the kernel's sweep list.

Run on a CUDA GPU: ``python benchmarks/dequant_library.py [--sweep] [--only NAME]``; prints
markdown and, when ``$OUT`` is set, writes it to ``$OUT/dequant_library_<gpu>.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _samples import random_bitnet, random_bnb_4bit, random_bnb_int8, random_gguf
from _timing import (
    ONE_CALL_TIMING,
    copy_bandwidths,
    header,
    publish,
    time_or_nan,
)

from qlens.kernels import dequantize_triton
from qlens.kernels.dequant_launch import DequantLaunch
from qlens.quant.codecs.gguf import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload

N, K = 28672, 8192
PAYLOADS: tuple[tuple[str, Callable[[], QuantPayload]], ...] = (
    ("bnb nf4 (blocksize 64)", lambda: random_bnb_4bit((N, K), 64, nested=False)),
    ("bnb nf4 nested", lambda: random_bnb_4bit((N, K), 64, nested=True)),
    ("bnb LLM.int8", lambda: random_bnb_int8(N, K)),
    *((f"gguf {t.name}", lambda t=t: random_gguf(t, (N, K))) for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)),
    ("bitnet", lambda: random_bitnet((N, K), "divide")),
)  # fmt: skip
# Rows x columns (BitNet: packed rows of four output rows) x warps.
SWEEP_2D = tuple(
    DequantLaunch(*t)
    for t in (
        (16, 256, 4), (8, 512, 4), (4, 1024, 4), (4, 2048, 8), (4, 512, 2), (2, 1024, 2),
        (2, 2048, 4), (1, 1024, 1), (1, 2048, 2), (1, 4096, 4), (2, 4096, 8),
    )
)  # fmt: skip
# bitsandbytes 4-bit is flat: block_n * block_k consecutive elements a program.
SWEEP_FLAT = tuple(
    DequantLaunch(*t)
    for t in ((16, 64, 2), (16, 128, 4), (16, 128, 8), (16, 256, 4), (16, 256, 8), (32, 256, 8),
              (64, 256, 8), (16, 512, 4))
)  # fmt: skip


def tile_label(tile: DequantLaunch) -> str:
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps}"


def sweep_for(payload: QuantPayload) -> tuple[DequantLaunch, ...]:
    flat = payload.format.name in ("bnb_nf4", "bnb_fp4")
    return SWEEP_FLAT if flat else SWEEP_2D


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every tile of the sweep lists")
    parser.add_argument("--only", default="", help="time only formats whose name contains this")
    args = parser.parse_args()
    copies = copy_bandwidths()
    copy_tbs = max(copies.values())
    rows = [
        header("qlens dequantize kernels, library layouts", ONE_CALL_TIMING),
        "- copy ceiling: " + ", ".join(f"{k} {v:.2f} TB/s" for k, v in copies.items())
        + f"; shape {N} x {K} -> bf16; the kernels skip their value checks (`check_values=False`)",
        "",
        "| format | bytes in+out (MB) | Triton us (default tile) | TB/s | % of copy | "
        "best swept tile | its us | its % of copy | eager us | torch.compile (codec) us | "
        "bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    sweeps = []
    compiled = torch.compile(dequantize, dynamic=False)
    for name, make in PAYLOADS:
        if args.only not in name:
            continue
        p = make().to("cuda")
        nbytes = p.nbytes + N * K * 2
        ref = dequantize(p, torch.bfloat16)
        exact = torch.equal(dequantize_triton(p, torch.bfloat16, check_values=False), ref)
        t = time_or_nan(lambda p=p: dequantize_triton(p, torch.bfloat16, check_values=False))
        best, best_t = "default", t
        if args.sweep:
            lines = []
            for tile in sweep_for(p):
                call = lambda p=p, tile=tile: dequantize_triton(  # noqa: E731
                    p, torch.bfloat16, launch=tile, check_values=False
                )
                exact = exact and torch.equal(call(), ref)
                tt = time_or_nan(call)
                lines.append(f"{tile_label(tile)}: {tt:.1f} us ({nbytes / tt / 1e6:.2f} TB/s)")
                if tt < best_t:
                    best, best_t = tile_label(tile), tt
            sweeps.append(f"- {name}: " + "; ".join(lines))
        del ref
        eager = time_or_nan(lambda p=p: dequantize(p, torch.bfloat16), graph=False)
        comp = time_or_nan(lambda p=p: compiled(p, torch.bfloat16), graph=False)
        tbs, best_tbs = nbytes / t / 1e6, nbytes / best_t / 1e6
        rows.append(
            f"| {name} | {nbytes / 1e6:.0f} | {t:.1f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% | "
            f"{best} | {best_t:.1f} | {100 * best_tbs / copy_tbs:.0f}% | {eager:.1f} | "
            f"{comp:.1f} | {exact} |"
        )
        print(rows[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    if sweeps:
        rows += ["", "## Tile sweep", "", *sweeps]
    publish("\n".join(rows), "dequant_library_h200.md")


if __name__ == "__main__":
    main()
