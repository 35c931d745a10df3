"""Software-pipelined loads in the one-row FMA GEMVs, swept on the H200.

Triton pipelines a loop's loads (``cp.async`` into shared memory, ``stages`` deep) only when the
loop asks for it (``tl.range(..., num_stages=...)``) or its loads feed a tensor-core dot. The
GEMVs' K loops take the depth from their launch (``LinearConfig.num_stages``; 1 = no
pipelining; the word-wise GEMV pipelines only its one-row loop). This sweeps it per launch and
depth, one row of ``x``: the word-wise GEMV for int4 / MXFP4 / NVFP4 and the byte-wise one for
fp8-block, against bf16 ``F.linear`` in the same run.

The dequantize kernel was swept the same way (several K tiles per program, pipelined) at commit
f6d78d5; it stayed within 2% of one tile per program, and that variant was removed.

Run on a CUDA GPU: ``python -m benchmarks.tuning.pipelining``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/pipelining_<gpu>.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._timing import (
    PACKED_4BIT_SCHEMES,
    header,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_linear,
)
from qlens.kernels import LinearConfig, dequantize_triton, quantized_linear
from qlens.quant.quantize import quantize_weight

GEMV_SHAPES = ((28672, 8192), (4096, 4096), (14336, 4096))
# (BLOCK_N, BLOCK_K, warps): BLOCK_K = 1024 x warps keeps x in the words' layout (packed_gemv).
WORD_LAUNCHES = ((4, 1024, 1), (8, 1024, 1), (4, 2048, 2), (8, 2048, 2))
BYTE_LAUNCHES = ((32, 256, 4), (16, 512, 4), (64, 256, 4))
STAGES = (1, 2, 3, 4)


def gemv_rows() -> list[str]:
    rows = [
        "| N x K | scheme | launch | " + " | ".join(f"stages {s} us" for s in STAGES)
        + " | bf16 us | best speed-up | worst rel. err |",
        "|---|---|---|" + "---|" * (len(STAGES) + 3),
    ]  # fmt: skip
    for n, k in GEMV_SHAPES:
        w = seeded_weight(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bf16 = rotation(w)
        base = time_bf16_linear(bf16, x)
        del bf16
        schemes = [(s, kw, WORD_LAUNCHES) for s, kw in PACKED_4BIT_SCHEMES]
        schemes.append(("fp8-block", {}, BYTE_LAUNCHES))
        for scheme, kw, launches in schemes:
            p = quantize_weight(w, scheme, **kw)
            ps = rotation(p)
            ref = F.linear(x.double(), dequantize_triton(p, torch.float32).double())
            for bn, bk, warps in launches:
                times, errs = [], []
                for stages in STAGES:
                    cfg = LinearConfig("gemv", 16, bn, bk, num_warps=warps, num_stages=stages)
                    errs.append(rel_err(quantized_linear(x, p, config=cfg), ref))
                    times.append(time_linear(ps, x, cfg))
                # A time whose result misses the reference (rel. err > 1e-2) is marked "(wrong)".
                cells = " | ".join(
                    f"{t:.1f}" + (" (wrong)" if e > 1e-2 else "")
                    for t, e in zip(times, errs, strict=True)
                )
                err = max(errs)
                rows.append(f"| {n} x {k} | {scheme} | {bn}x{bk} w{warps} | {cells} | {base:.1f} "
                            f"| {base / min(times):.2f}x | {err:.1e} |")  # fmt: skip
                print(rows[-1], flush=True)
            del ps
        del w
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    out = [
        header("Software-pipelined loads: one-row FMA GEMV"),
        "",
        "## One-row GEMV, us per call",
        "",
        *gemv_rows(),
    ]
    publish("\n".join(out), "pipelining_h200.md")


if __name__ == "__main__":
    main()
