"""Where an eager one-row quantized linear spends its time on the GPU: wall microseconds per call
of each step of ``quantized_linear`` (back-to-back calls, one sync at the end), and the
functions that take the most host time under ``cProfile``.

Run on a CUDA GPU: ``python -m benchmarks.tuning.eager_profile``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/eager_profile_<gpu>.md``.
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats

import torch
import torch.nn.functional as F

import qlens.kernels.gemv as gemv
from benchmarks._timing import header, publish, time_eager_loop
from qlens.kernels import quantized_linear
from qlens.kernels.dispatch import default_config
from qlens.kernels.weights import kernel_weight
from qlens.modules import QuantLinear
from qlens.quant.quantize import quantize_weight

SHAPE = (4096, 4096)
CALLS = 500


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    w = torch.randn(*SHAPE, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, SHAPE[1], device=dev, dtype=torch.bfloat16)
    timing = (
        f"wall time per call of {CALLS} back-to-back eager calls, one "
        f"`torch.cuda.synchronize()` at the end; cProfile over another {CALLS} calls"
    )
    lines = [header("Eager one-row quantized linear: host time by step", timing), ""]
    lines += ["| step | int4 us a call | mxfp4 us a call |", "|---|---|---|"]
    steps: dict[str, list[float]] = {}
    profiles = []
    for scheme, options in (("int4", {"group_size": 128}), ("mxfp4", {})):
        p = quantize_weight(w, scheme, **options)
        kw = kernel_weight(p)
        cfg = default_config(p, 1, dev)
        prepared = gemv.prepared_gemv(kw, 1, x.dtype, False, cfg)
        cases = {
            "bf16 F.linear": functools.partial(F.linear, x, w),
            "QuantLinear forward (whole call, kept plan)": functools.partial(QuantLinear(p), x),
            "quantized_linear (whole call)": functools.partial(quantized_linear, x, p),
            "quantized_linear, launch given": functools.partial(quantized_linear, x, p, config=cfg),
            "gemv_linear": functools.partial(gemv.gemv_linear, x, kw, None, cfg),
            "prepared GEMV (kernel launch)": functools.partial(prepared, x, None),
            "default_config": functools.partial(default_config, p, 1, dev),
            "kernel_weight": functools.partial(kernel_weight, p),
            "torch.empty": functools.partial(torch.empty, (1, kw.n), dtype=x.dtype, device=dev),
        }
        for name, call in cases.items():
            steps.setdefault(name, []).append(time_eager_loop(call, CALLS))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            quantized_linear(x, p)
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        profiles.append((scheme, text.getvalue()))
    lines += [f"| {name} | {a:.1f} | {b:.1f} |" for name, (a, b) in steps.items()]
    for scheme, text in profiles:
        lines += ["", f"## cProfile of {CALLS} calls, {scheme} (by own time)", "", "```"]
        lines += [line.rstrip() for line in text.splitlines() if line.strip()][:40]
        lines += ["```"]
    publish("\n".join(lines), "eager_profile_h200.md")


if __name__ == "__main__":
    main()
