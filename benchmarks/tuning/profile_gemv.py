"""One launch each of the int4 decode kernels on 28672 x 8192 (1, 4 and 16 rows), for a
hardware-counter profile:

    ncu --clock-control none -k regex:packed_gemv --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats python -m benchmarks.tuning.profile_gemv

Each launch runs once, on its first call (compile included on the host, not in the profile).
"""

from __future__ import annotations

import torch

from benchmarks._timing import seeded_weight
from qlens.kernels import LinearConfig, quantized_linear
from qlens.quant.quantize import quantize_weight

LAUNCHES = {
    "word GEMV (default, 1 row)": (1, None),
    "word GEMV (default, 4 rows)": (4, None),
    "word GEMV (default, 16 rows)": (16, None),
    "word GEMV, 8 x 1024, 3 stages (1 row)": (
        1,
        LinearConfig("gemv", 16, 8, 1024, num_warps=1, num_stages=3),
    ),
}


def main() -> None:
    dev = torch.device("cuda")
    w = seeded_weight(28672, 8192, dev)
    p = quantize_weight(w, "int4", group_size=128)
    for name, (m, cfg) in LAUNCHES.items():
        x = torch.randn(m, 8192, device=dev, dtype=torch.bfloat16)
        quantized_linear(x, p, config=cfg)
        torch.cuda.synchronize()
        print(name, flush=True)


if __name__ == "__main__":
    main()
