"""One-row GEMVs on narrow layers: a K split (a second, reducing launch) against narrower
column tiles that fill the GPU in one launch.

The dispatcher splits a one-row GEMV's K when its grid has fewer programs than SMs. On the
narrow layers of unfused HF models (the 8B shape's 1024-row k/v projections, the 1B shape's
512-row k/v and its 2048-wide layers) that gives fp8-block up to five of seven linears a layer
with two launches at the 1B shape. Eager decode is host-bound, so each launch costs host time
whatever the kernel saves; a narrower tile may fill the GPU as well without it. Each launch is
timed two ways: replayed in a CUDA graph (kernel time, the reduction included) and called
back to back through the modules' ``LinearPlan`` (what an eager decode pays, host included).

Run on a CUDA GPU: ``python -m benchmarks.tuning.narrow_rows``; prints markdown and, when
``$OUT`` is set, writes it to ``$OUT/narrow_rows_<gpu>.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from benchmarks._timing import (
    LAUNCH_ERRORS,
    header,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_eager_loop,
    time_linear,
)
from qlens.kernels import LinearConfig, choose_config, dequantize_triton
from qlens.kernels.plan import LinearPlan
from qlens.quant.quantize import quantize_weight

# (N, K, where the layer is)
LAYERS = (
    (1024, 4096, "8B k/v"),
    (512, 2048, "1B k/v"),
    (2048, 2048, "1B q/o"),
    (2048, 8192, "1B down"),
)
SCHEMES = (("fp8-block", {}), ("int4", {"group_size": 128}), ("nvfp4", {}))


def candidates(auto: LinearConfig, packed: bool) -> list[LinearConfig]:
    """The dispatcher's launch, it unsplit, and narrower column tiles unsplit and split."""
    unsplit = replace(auto, split_k=1)
    found = [auto, unsplit]
    block_n = auto.block_n // 2
    while block_n >= 4:
        found += [replace(unsplit, block_n=block_n), replace(unsplit, block_n=block_n, split_k=2)]
        block_n //= 2
    if packed:  # the packed GEMV's tile is four rows already: longer K a program instead
        shorter = replace(unsplit, block_k=max(unsplit.block_k // 2, 256))
        found += [shorter, replace(shorter, split_k=2)]
    unique: list[LinearConfig] = []
    for cfg in found:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def eager_us(payload, x: torch.Tensor, cfg: LinearConfig) -> float:
    """Wall microseconds a call of ``cfg`` through a ``LinearPlan`` (the modules' path), back
    to back."""
    plan = LinearPlan(payload, x.device)
    plan._configs[x.shape[0]] = cfg  # the launch under test, as if the table chose it
    return time_eager_loop(lambda: plan(x))


def label(cfg: LinearConfig) -> str:
    return f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages} s{cfg.split_k}"


def main() -> None:
    dev = torch.device("cuda")
    rows = [
        "| layer | N x K | scheme | launch | graph us | eager us a call | graph vs dispatcher "
        "| eager vs dispatcher | rel. err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, k, where in LAYERS:
        w = seeded_weight(n, k, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = time_bf16_linear(rotation(w), x)
        e_bf16 = time_eager_loop(lambda w=w, x=x: F.linear(x, w))
        rows.append(
            f"| {where} | {n} x {k} | bf16 | F.linear | {t_bf16:.1f} | {e_bf16:.1f} | | | |"
        )
        print(rows[-1], flush=True)
        for scheme, options in SCHEMES:
            payload = quantize_weight(w, scheme, **options)
            payloads = rotation(payload)
            packed = scheme != "fp8-block"
            auto = choose_config(1, n, k, dev, packed_words=packed, int4=scheme == "int4")
            exact = F.linear(x.float(), dequantize_triton(payload, torch.float32))
            base_graph = base_eager = float("nan")
            for cfg in candidates(auto, packed):
                try:
                    graph = time_linear(payloads, x, cfg)
                    eager = eager_us(payload, x, cfg)
                    plan = LinearPlan(payload, dev)
                    plan._configs[1] = cfg
                    err = rel_err(plan(x), exact)
                except LAUNCH_ERRORS as error:
                    print(f"<!-- {cfg} failed: {str(error)[:200]} -->", flush=True)
                    continue
                if cfg == auto:
                    base_graph, base_eager = graph, eager
                name = label(cfg) + (" (dispatcher)" if cfg == auto else "")
                rows.append(
                    f"| {where} | {n} x {k} | {scheme} | {name} | {graph:.1f} | {eager:.1f} | "
                    f"{base_graph / graph:.2f}x | {base_eager / eager:.2f}x | {err:.1e} |"
                )
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    publish(
        header("One-row GEMVs on narrow layers: K splits against narrower tiles") + "\n".join(rows),
        "narrow_rows_h200.md",
    )


if __name__ == "__main__":
    main()
