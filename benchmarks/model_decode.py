"""Decode step and prefill of an 8B-shaped Llama-like stack of linears (random weights), per
scheme vs bf16.

Run on a CUDA GPU: ``python benchmarks/model_decode.py``; prints markdown. Decode runs one token
(M = 1), prefill ``PREFILL_TOKENS`` tokens at once. Only the linear layers are timed (attention, norms and activations are the same for every scheme): 32 layers of
fused qkv [6144, 4096], o [4096, 4096], fused gate_up [28672, 4096] and down [4096, 14336].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _timing import (
    DECODE_LAYERS_8B,
    LAUNCH_ERRORS,
    clone_payload,
    header,
    publish,
    time_graph,
)

from qlens.kernels import quantized_linear
from qlens.quant.quantize import quantize_weight

LAYERS = 32
PREFILL_TOKENS = 2048
SCHEMES = (
    ("fp8-block W8A8", "fp8-block", {}, True),
    ("fp8-block W8A16", "fp8-block", {}, False),
    ("int4 g128", "int4", {"group_size": 128}, False),
    ("mxfp4", "mxfp4", {}, False),
    ("nvfp4", "nvfp4", {}, False),
)


def _step(layer_fns, x_in):
    """One decode token through every layer's four linears (outputs feed the next input)."""

    def run():
        h = x_in
        for qkv, o, gate_up, down in layer_fns:
            qkv(h)
            h2 = o(h)
            up = gate_up(h2)
            h = down(up[:, :14336])

    return run


def _timed(name, fns, x, replays):
    try:
        return time_graph([_step(fns, x)], replays=replays)
    except LAUNCH_ERRORS as err:
        print(f"<!-- {name} failed: {str(err)[:300]} -->")
        return float("nan")


def main():
    torch.manual_seed(0)
    base = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in DECODE_LAYERS_8B
    ]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    xp = torch.randn(PREFILL_TOKENS, 4096, device="cuda", dtype=torch.bfloat16)
    bf16_layers = [[w.clone() for w in base] for _ in range(LAYERS)]
    bf16_bytes = sum(w.numel() * 2 for layer in bf16_layers for w in layer)
    fns = [[lambda a, w=w: F.linear(a, w) for w in layer] for layer in bf16_layers]
    bf16_us = time_graph([_step(fns, x)], replays=10)
    bf16_prefill = time_graph([_step(fns, xp)], replays=5)
    del bf16_layers, fns
    out = [
        header(
            f"qlens decode step (M = 1) and prefill (M = {PREFILL_TOKENS}), 8B-shaped linears",
            "one CUDA graph per step over every layer's distinct weights (launch gaps excluded), "
            "replayed for 50 ms before timing, median of 10 replays (prefill: 5)",
        ),
        "| scheme | decode step us | decode speed-up vs bf16 | prefill ms | prefill speed-up "
        "| weight GB | memory vs bf16 |",
        "|---|---|---|---|---|---|---|",
        f"| bf16 | {bf16_us:.0f} | 1.00x | {bf16_prefill / 1e3:.1f} | 1.00x | "
        f"{bf16_bytes / 1e9:.2f} | 1.00x |",
    ]
    print(out[-1], flush=True)
    for name, scheme, options, w8a8 in SCHEMES:
        first = [quantize_weight(w, scheme, **options) for w in base]
        layers = [first] + [[clone_payload(p) for p in first] for _ in range(LAYERS - 1)]
        nbytes = sum(p.nbytes for layer in layers for p in layer)
        fns = [
            [lambda a, p=p, w8=w8a8: quantized_linear(a, p, w8a8=w8) for p in layer]
            for layer in layers
        ]
        us, prefill = _timed(name, fns, x, 10), _timed(name + " prefill", fns, xp, 5)
        out.append(
            f"| {name} | {us:.0f} | {bf16_us / us:.2f}x | {prefill / 1e3:.1f} | "
            f"{bf16_prefill / prefill:.2f}x | {nbytes / 1e9:.2f} | {bf16_bytes / nbytes:.2f}x less |"
        )
        print(out[-1], flush=True)
        del layers, fns, first
        torch.cuda.empty_cache()
    publish("\n".join(out), "model_decode.md")


if __name__ == "__main__":
    main()
