"""Dequantize program order and store hint: the default tile with its programs ordered along N
first (the launch grid's default) or K first (consecutive programs fill one band of rows), with
plain or streaming (evict-first) stores, per scheme, against the same-run copy ceiling.

Run on a CUDA GPU: ``python benchmarks/dequant_order.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/dequant_order_h200.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from dequant import SCHEMES, SHAPE

from qlens.kernels import dequantize_triton
from qlens.kernels.dequant import GPU_DEQUANT_LAUNCH, DequantLaunch
from qlens.kernels.timing import copy_bandwidths, header, publish, seeded_weight, time_graph
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

TILES = (GPU_DEQUANT_LAUNCH, DequantLaunch(32, 1024, 8), DequantLaunch(16, 2048, 8))
VARIANTS = tuple(
    replace(tile, k_fastest=k_fastest, streaming=streaming)
    for tile in TILES
    for k_fastest in (False, True)
    for streaming in (False, True)
)


def _label(tile: DequantLaunch) -> str:
    order = "K-first" if tile.k_fastest else "N-first"
    store = " .cs" if tile.streaming else ""
    return f"{tile.block_n}x{tile.block_k} w{tile.num_warps} {order}{store}"


def main() -> None:
    copies = copy_bandwidths()
    copy_tbs = max(copies.values())
    rows = [
        header("Dequantize program order and store hint"),
        "- copy ceiling: " + ", ".join(f"{k} {v:.2f} TB/s" for k, v in copies.items())
        + f"; shape {SHAPE[0]} x {SHAPE[1]} -> bf16; cells: us (% of the fastest copy)",
        "",
        "| scheme | " + " | ".join(_label(v) for v in VARIANTS) + " | bit-exact |",
        "|---|" + "---|" * len(VARIANTS) + "---|",
    ]  # fmt: skip
    w = seeded_weight(*SHAPE)
    for scheme, kw in SCHEMES:
        p = quantize_weight(w, scheme, **kw)
        nbytes = p.nbytes + w.numel() * 2
        ref = dequantize(p, torch.bfloat16)
        exact = all(
            torch.equal(dequantize_triton(p, torch.bfloat16, launch=v), ref) for v in VARIANTS
        )
        cells = []
        for v in VARIANTS:
            t = time_graph([lambda p=p, v=v: dequantize_triton(p, torch.bfloat16, launch=v)],
                           replays=10)  # fmt: skip
            cells.append(f"{t:.1f} ({100 * nbytes / t / 1e6 / copy_tbs:.0f}%)")
        name = scheme + (" " + ",".join(f"{a}={b}" for a, b in kw.items()) if kw else "")
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {exact} |")
        print(rows[-1], flush=True)
        del ref
    publish("\n".join(rows), "dequant_order_h200.md")


if __name__ == "__main__":
    main()
