"""Dequantize kernels of the library layouts (bitsandbytes NF4 flat and nested, LLM.int8, GGUF
Q4_0-Q8_0, BitNet) on random payloads of a 28672 x 8192 weight, against eager torch and
``torch.compile`` of the codec, as a share of the same-run copy ceiling (packed bytes read plus
bf16 bytes written).

Run on a CUDA GPU: ``python benchmarks/dequant_library.py``; prints markdown and, when ``$OUT``
is set, writes it to ``$OUT/dequant_library_h200.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qlens.kernels import dequantize_triton
from qlens.kernels.timing import copy_bandwidths, header, publish, time_eager, time_graph
from qlens.quant.codecs.gguf import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload
from qlens.quant.samples import random_bitnet, random_bnb_4bit, random_bnb_int8, random_gguf

N, K = 28672, 8192
PAYLOADS: tuple[tuple[str, Callable[[], QuantPayload]], ...] = (
    ("bnb nf4 (blocksize 64)", lambda: random_bnb_4bit((N, K), 64, nested=False)),
    ("bnb nf4 nested", lambda: random_bnb_4bit((N, K), 64, nested=True)),
    ("bnb LLM.int8", lambda: random_bnb_int8(N, K)),
    *((f"gguf {t.name}", lambda t=t: random_gguf(t, (N, K))) for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)),
    ("bitnet", lambda: random_bitnet((N, K), "divide")),
)  # fmt: skip


def _time(fn, graph: bool = True) -> float:
    try:
        return time_graph([fn], replays=10) if graph else time_eager(fn)
    except (RuntimeError, ValueError, TypeError, AssertionError) as err:
        print(f"<!-- failed: {str(err)[:300]} -->", flush=True)
        return float("nan")


def main() -> None:
    copies = copy_bandwidths()
    copy_tbs = max(copies.values())
    rows = [
        header("qlens dequantize kernels, library layouts"),
        "- copy ceiling: " + ", ".join(f"{k} {v:.2f} TB/s" for k, v in copies.items())
        + f"; shape {N} x {K} -> bf16; the kernels skip their value checks (`check_values=False`)",
        "",
        "| format | bytes in+out (MB) | Triton us | TB/s | % of copy | eager us | "
        "torch.compile (codec) us | bit-exact |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    compiled = torch.compile(dequantize, dynamic=False)
    for name, make in PAYLOADS:
        p = make().to("cuda")
        nbytes = p.nbytes + N * K * 2
        ref = dequantize(p, torch.bfloat16)
        exact = torch.equal(dequantize_triton(p, torch.bfloat16, check_values=False), ref)
        del ref
        t = _time(lambda p=p: dequantize_triton(p, torch.bfloat16, check_values=False))
        eager = _time(lambda p=p: dequantize(p, torch.bfloat16), graph=False)
        comp = _time(lambda p=p: compiled(p, torch.bfloat16), graph=False)
        tbs = nbytes / t / 1e6
        rows.append(
            f"| {name} | {nbytes / 1e6:.0f} | {t:.1f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% | "
            f"{eager:.1f} | {comp:.1f} | {exact} |"
        )
        print(rows[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    publish("\n".join(rows), "dequant_library_h200.md")


if __name__ == "__main__":
    main()
