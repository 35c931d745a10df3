"""Default-dispatch times of a few 4-bit (M, N, K) products against bf16 ``F.linear``: a quick
check after a kernel change.

Run on a CUDA GPU: ``python -m benchmarks.tuning.decode_check``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/decode_check_<gpu>.md``.
"""

from __future__ import annotations

import torch

from benchmarks._timing import (
    header,
    publish,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_linear,
)
from qlens.quant.quantize import quantize_weight

CASES = ((1, 28672, 8192), (1, 4096, 14336), (16, 4096, 4096), (16, 4096, 14336), (16, 14336, 4096))
SCHEMES = ("mxfp4", "nvfp4")


def main() -> None:
    rows = ["| M | N x K | bf16 us | " + " | ".join(f"{s} us (vs bf16)" for s in SCHEMES) + " |",
            "|---|---|---|" + "---|" * len(SCHEMES)]  # fmt: skip
    for m, n, k in CASES:
        w = seeded_weight(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = rotation(w)
        base = time_bf16_linear(bf16, x)
        cells = []
        for scheme in SCHEMES:
            p0 = quantize_weight(w, scheme)
            ps = rotation(p0)
            t = time_linear(ps, x)
            cells.append(f"{t:.1f} ({base / t:.2f}x)")
        rows.append(f"| {m} | {n} x {k} | {base:.1f} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    publish(header("Default-dispatch 4-bit products") + "\n".join(rows), "decode_check_h200.md")


if __name__ == "__main__":
    main()
