"""4-bit dequantize: the word-wise kernel (``qlens.kernels.dequant_words``) against the byte-wise
one (``qlens.kernels.dequant``) in the same run, on 28672 x 8192 to bf16, with the copy ceiling.

``run`` is the words a thread loads at once (``tl.max_contiguous`` on the word offsets).
Run on a CUDA GPU: ``python benchmarks/dequant_words.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/dequant_words_h200.md``.
"""

from __future__ import annotations

from functools import partial

import torch

from qlens.kernels.dequant import GPU_DEQUANT_LAUNCH, dequantize_triton
from qlens.kernels.dequant_words import dequantize_words
from qlens.kernels.gemv import word_view
from qlens.kernels.timing import copy_bandwidths, header, publish, time_graph
from qlens.kernels.weights import kernel_weight
from qlens.quant.quantize import quantize_weight

SHAPE = (28672, 8192)
SCHEMES = (
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 128, "asymmetric": True}),
    ("mxfp4", {}),
    ("nvfp4", {}),
)
# (BLOCK_N, BLOCK_K, warps, words a thread loads at once)
TILES = ((16, 1024, 4, 4), (16, 1024, 4, 2), (16, 1024, 4, 1), (8, 1024, 4, 4), (32, 1024, 8, 4),
         (16, 2048, 8, 4), (16, 512, 4, 4))  # fmt: skip


def _percent(nbytes: int, ceiling: float, t: float) -> float:
    return 100 * nbytes / t / 1e6 / ceiling


def main() -> None:
    copies = copy_bandwidths()
    ceiling = max(copies.values())
    d = GPU_DEQUANT_LAUNCH
    rows = [
        f"- copy ceiling (fastest of {', '.join(f'{k} {v:.2f}' for k, v in copies.items())} "
        f"TB/s): {ceiling:.2f} TB/s, read + write",
        "",
        f"| scheme | MB in+out | byte-wise {d.block_n}x{d.block_k} w{d.num_warps} us (% of copy) | "
        + " | ".join(f"words {bn}x{bk} w{w} run{r}" for bn, bk, w, r in TILES)
        + " | best words % of copy | best vs byte-wise | bit-exact |",
        "|---|---|---|" + "---|" * len(TILES) + "---|---|---|",
    ]  # fmt: skip
    torch.manual_seed(0)
    w = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) * 0.02
    for scheme, kw in SCHEMES:
        p = quantize_weight(w, scheme, **kw)
        kw_ = kernel_weight(p)
        words = word_view(kw_)
        assert words is not None
        nbytes = p.nbytes + w.numel() * 2
        reference = dequantize_triton(p, torch.bfloat16)
        t_bytes = time_graph([lambda p=p: dequantize_triton(p, torch.bfloat16)], replays=10)
        out = torch.empty_like(reference)
        times, exact = [], True
        for bn, bk, warps, run in TILES:
            out.fill_(float("nan"))
            dequantize_words(kw_, words, out, bn, bk, warps, run)
            exact &= torch.equal(out.view(torch.int16), reference.view(torch.int16))
            call = partial(dequantize_words, kw_, words, out, bn, bk, warps, run)
            times.append(time_graph([call], replays=10))
        best = min(times)
        pct = partial(_percent, nbytes, ceiling)
        label = scheme + "".join(f" {k}={v}" for k, v in kw.items())
        rows.append(
            f"| {label} | {nbytes / 1e6:.0f} | {t_bytes:.1f} ({pct(t_bytes):.0f}%) | "
            + " | ".join(f"{t:.1f} ({pct(t):.0f}%)" for t in times)
            + f" | {pct(best):.0f}% | {t_bytes / best:.2f}x | {exact} |"
        )
        print(rows[-1], flush=True)
    again = copy_bandwidths()
    rows.append(
        f"\n- copy re-measured at the end: {', '.join(f'{k} {v:.2f}' for k, v in again.items())} TB/s"
    )
    publish(header("4-bit dequantize: word-wise vs byte-wise kernel") + "\n".join(rows),
            "dequant_words_h200.md")  # fmt: skip


if __name__ == "__main__":
    main()
