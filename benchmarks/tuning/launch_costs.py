"""What a one-row packed 4-bit linear costs besides its GEMV kernel, on the 8B decode layers.

Graph-timed (weights streamed from memory): bf16 ``F.linear``, the whole ``quantized_linear``
call, the same call with the activations' regrouping launch (``permute_codes``) taken out of the
graph (the regrouped row computed once beforehand), and that launch alone. Eager: the wall time
per call of a loop of back-to-back calls, synchronized once at the end, as an eager decode loop
pays it (host work included).

Run on a CUDA GPU: ``python -m benchmarks.tuning.launch_costs``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/launch_costs_<gpu>.md``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import qlens.kernels.gemv as gemv
from benchmarks._timing import (
    DECODE_LAYERS_8B,
    header,
    publish,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_eager_loop,
    time_graph,
)
from qlens.kernels import quantized_linear
from qlens.quant.quantize import quantize_weight

SCHEMES = (("int4", {"group_size": 128}), ("mxfp4", {}))


def main() -> None:
    rows = [
        "| N x K | scheme | bf16 us | call us | call without the regrouping us | regrouping "
        "alone us | eager bf16 us a call | eager call us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    permute = gemv.permute_codes
    for n, k in DECODE_LAYERS_8B:
        w = seeded_weight(n, k)
        bf16 = rotation(w)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t_bf16 = time_bf16_linear(bf16, x)
        e_bf16 = time_eager_loop(functools.partial(F.linear, x, bf16[0]))
        del bf16
        for scheme, options in SCHEMES:
            payloads = rotation(quantize_weight(w, scheme, **options))
            calls = [functools.partial(quantized_linear, x, p) for p in payloads]
            t_call = time_graph(calls)
            regrouped = permute(x, for_dot=False)
            gemv.permute_codes = lambda rows, for_dot, ready=regrouped: ready
            try:
                t_bare = time_graph(calls)
            finally:
                gemv.permute_codes = permute
            t_permute = time_graph([functools.partial(permute, x, for_dot=False)] * 16)
            e_call = time_eager_loop(calls[0])
            rows.append(
                f"| {n} x {k} | {scheme} | {t_bf16:.1f} | {t_call:.1f} | {t_bare:.1f} | "
                f"{t_permute:.1f} | {e_bf16:.1f} | {e_call:.1f} |"
            )
            print(rows[-1], flush=True)
            del payloads, calls
        torch.cuda.empty_cache()
    publish(
        header("One-row packed linears: the regrouping launch and eager calls") + "\n".join(rows),
        "launch_costs_h200.md",
    )


if __name__ == "__main__":
    main()
