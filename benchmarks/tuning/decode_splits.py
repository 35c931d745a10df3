"""K splits for the decode launches on the linears of an 8B-shaped decode step, against the
dispatcher's launch and bf16 (the partials summed in split order by a second launch).

Run on a CUDA GPU: ``python -m benchmarks.tuning.decode_splits``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/decode_splits_<gpu>.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from benchmarks._timing import (
    DECODE_LAYERS_8B,
    LAUNCH_ERRORS,
    header,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_linear,
)
from qlens.kernels import LinearConfig, choose_config, dequantize_triton, quantized_linear
from qlens.quant.quantize import quantize_weight

# (label, scheme, quantize kwargs, w8a8, M, launch) ; splits are swept over each launch.
CASES = (
    ("int4 word", "int4", {"group_size": 128}, False, 1, LinearConfig("gemv", 16, 4, 1024, num_warps=1, num_stages=1)),
    ("mxfp4 word", "mxfp4", {}, False, 1, LinearConfig("gemv", 16, 4, 1024, num_warps=1, num_stages=1)),
    ("nvfp4 word", "nvfp4", {}, False, 1, LinearConfig("gemv", 16, 4, 1024, num_warps=1, num_stages=1)),
    ("fp8 W8A16 byte", "fp8-block", {}, False, 1, LinearConfig("gemv", 16, 16, 512, num_warps=4, num_stages=4)),
    ("fp8 W8A8 split-K", "fp8-block", {}, True, 1, LinearConfig("splitk", 16, 64, 128, num_warps=4, num_stages=4)),
    ("int4 word", "int4", {"group_size": 128}, False, 16, LinearConfig("gemv", 16, 64, 256, num_warps=4, num_stages=3)),
    ("mxfp4 word", "mxfp4", {}, False, 16, LinearConfig("gemv", 16, 64, 256, num_warps=4, num_stages=3)),
    ("nvfp4 word", "nvfp4", {}, False, 16, LinearConfig("gemv", 16, 64, 256, num_warps=4, num_stages=3)),
)  # fmt: skip
SPLITS = (1, 2, 4, 8, 16)


def _time(ps, x, cfg, w8a8) -> float:
    try:
        return time_linear(ps, x, cfg, w8a8=w8a8)
    except LAUNCH_ERRORS as err:
        print(f"<!-- {cfg} failed: {str(err)[:200]} -->", flush=True)
        return float("nan")


def main() -> None:
    dev = torch.device("cuda")
    cols = [f"s{s}" for s in SPLITS]
    rows = [
        "| case | M | N x K | bf16 us | dispatcher (split) us | "
        + " | ".join(cols) + " | best vs bf16 | rel. err (s4) |",
        "|---|---|---|---|---|" + "---|" * len(cols) + "---|---|",
    ]  # fmt: skip
    for n, k in DECODE_LAYERS_8B:
        w = seeded_weight(n, k, dev)
        bf16 = rotation(w)
        payloads = {}
        for label, scheme, kw, w8a8, m, base_cfg in CASES:
            key = (scheme, tuple(kw.items()))
            if key not in payloads:
                p0 = quantize_weight(w, scheme, **kw)
                payloads[key] = rotation(p0)
            ps = payloads[key]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = time_bf16_linear(bf16, x)
            auto = choose_config(
                m, n, k, dev, w8a8=w8a8, packed_words="word" in label, int4=scheme == "int4"
            )
            t_auto = _time(ps, x, None, w8a8)
            times = {f"s{s}": _time(ps, x, replace(base_cfg, split_k=s), w8a8) for s in SPLITS}
            out = quantized_linear(x, ps[0], config=replace(base_cfg, split_k=4), w8a8=w8a8)
            exact = F.linear(x.float(), dequantize_triton(ps[0], torch.float32))
            rel = rel_err(out, exact)
            best = min(v for v in times.values() if v == v)
            rows.append(
                f"| {label} | {m} | {n} x {k} | {t_bf16:.1f} | {t_auto:.1f} ({auto.split_k}) | "
                + " | ".join(f"{times[c]:.1f}" for c in cols)
                + f" | {t_bf16 / best:.2f}x | {rel:.1e} |"
            )
            print(rows[-1], flush=True)
        del bf16, payloads
        torch.cuda.empty_cache()
    publish(header("K splits of the decode launches") + "\n".join(rows), "decode_splits_h200.md")


if __name__ == "__main__":
    main()
