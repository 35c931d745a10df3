"""One launch each of the int4 decode kernels on 28672 x 8192 (one row and 16 rows), for a
hardware-counter profile:

    ncu --clock-control none -k regex:"gemv|pairs" --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats python benchmarks/profile_gemv.py

Each kernel runs once after a warm-up call outside the profiled range is not possible with
Triton's first-call compile, so every launch is counted; pass ``--launch-skip`` to ncu to
drop the compile-time ones if needed.
"""

from __future__ import annotations

import torch

from qlens.kernels import LinearConfig, quantized_linear
from qlens.quant.quantize import quantize_weight

LAUNCHES = {
    "word GEMV (default, 1 row)": (1, None),
    "pairs 32x256 w1 st3 (1 row)": (1, LinearConfig("pairs", 16, 32, 256, num_warps=1)),
    "word GEMV (default, 16 rows)": (16, None),
    "pairs 128x128 w4 st3 (16 rows)": (16, LinearConfig("pairs", 16, 128, 128)),
}


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(28672, 8192, device=dev, dtype=torch.bfloat16) * 0.02
    p = quantize_weight(w, "int4", group_size=128)
    for name, (m, cfg) in LAUNCHES.items():
        x = torch.randn(m, 8192, device=dev, dtype=torch.bfloat16)
        quantized_linear(x, p, config=cfg)
        torch.cuda.synchronize()
        print(name, flush=True)


if __name__ == "__main__":
    main()
