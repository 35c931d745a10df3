"""Quantized linear kernels vs bf16 ``F.linear``, cuBLAS blockwise FP8, gemlite (int4, group
128, when installed), torch's tinygemm (``aten._weight_int4pack_mm``, int4 group 128) and
dequantize-then-matmul.

Run on a CUDA GPU: ``python benchmarks/kernels.py [--sweep] [--quick]``; prints markdown.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import (
    BENCHMARK_LAYERS,
    PACKED_4BIT_SCHEMES,
    clone_payload,
    copies_for,
    header,
    publish,
    seeded_weight,
    time_graph,
    time_linear,
)
from _tinygemm import tinygemm_int4
from kernels_decode import gemlite_layers

from qlens.kernels import LinearConfig, choose_config, dequantize_triton, quantized_linear
from qlens.kernels.fp8_w8a8 import quantize_activations
from qlens.quant.quantize import quantize_weight

M_VALUES = (1, 16, 64, 256, 1024, 4096)


def scaled_mm_blockwise(x, w_fp8, w_scales):
    """cuBLAS blockwise FP8 (1x128 activations, 128x128 weights) with qlens' activation quant."""
    m = x.shape[0]
    pad = (-m) % 16
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    a, a_s = quantize_activations(xp, 128)
    out = torch._scaled_mm(
        a, w_fp8.t(), scale_a=a_s, scale_b=w_scales.t(),
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    return out[:m]


def scaled_mm_gemm_only(a, a_s, w_fp8, w_scales):
    return torch._scaled_mm(
        a, w_fp8.t(), scale_a=a_s, scale_b=w_scales.t(), out_dtype=torch.bfloat16
    )


def _bench_batch(m, n, k, ws_bf16, fp8, w4, gemlite, tinygemm):
    """Microseconds of every method at batch ``m``."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    res = {}

    def run(name, calls):
        try:
            res[name] = time_graph(calls)
        except (RuntimeError, ValueError, TypeError, AssertionError) as err:
            res[name] = float("nan")
            print(f"<!-- {name} {m}x{n}x{k} failed: {str(err)[:200]} -->")

    run("bf16", [lambda wb=wb: F.linear(x, wb) for wb in ws_bf16])
    run("fp8_w8a8", [lambda p=p: quantized_linear(x, p, w8a8=True) for p in fp8])
    run("fp8_w8a16", [lambda p=p: quantized_linear(x, p) for p in fp8])
    a, a_s = quantize_activations(x if m % 16 == 0 else F.pad(x, (0, 0, 0, (-m) % 16)), 128)
    run(
        "cublas_block_gemm",
        [lambda p=p: scaled_mm_gemm_only(a, a_s, p.data, p.scales) for p in fp8],
    )
    run("cublas_block+actq", [lambda p=p: scaled_mm_blockwise(x, p.data, p.scales) for p in fp8])
    for s, _ in PACKED_4BIT_SCHEMES:
        run(s, [lambda p=p: quantized_linear(x, p) for p in w4[s]])
    if gemlite:
        run("gemlite_int4", [lambda layer=layer: layer(x) for layer in gemlite])
    else:
        res["gemlite_int4"] = float("nan")
    if tinygemm:
        run("tinygemm_int4", [lambda mm=mm: mm(x) for mm in tinygemm])
    else:
        res["tinygemm_int4"] = float("nan")
    run(
        "int4_dequant+mm",
        [lambda p=p: F.linear(x, dequantize_triton(p, torch.bfloat16)) for p in w4["int4"]],
    )
    return res


def bench_shape(n, k, m_values, rows):
    w = seeded_weight(n, k)
    copies = {}

    def weights(key, make, nbytes):
        if key not in copies:
            first = make()
            copies[key] = [first] + [
                clone_payload(first) if not torch.is_tensor(first) else first.clone()
                for _ in range(copies_for(nbytes) - 1)
            ]
        return copies[key]

    ws_bf16 = weights("bf16", lambda: w, n * k * 2)
    fp8 = weights("fp8", lambda: quantize_weight(w, "fp8-block"), n * k)
    w4 = {
        s: weights(s, lambda s=s, kw=kw: quantize_weight(w, s, **kw), n * k // 2)
        for s, kw in PACKED_4BIT_SCHEMES
    }
    gemlite = gemlite_layers(w4["int4"], n, k)
    tinygemm = tinygemm_layers(w4["int4"])
    for m in m_values:
        res = _bench_batch(m, n, k, ws_bf16, fp8, w4, gemlite, tinygemm)
        cfg = choose_config(m, n, k, torch.device("cuda"))
        rows.append((m, n, k, cfg.path, res))
        print(
            f"<!-- {m}x{n}x{k}: " + ", ".join(f"{a}={b:.1f}" for a, b in res.items()) + " -->",
            flush=True,
        )


def tinygemm_layers(ps) -> list:
    """tinygemm products over the int4 payloads ``ps`` (same codes and scales), or none where
    this torch lacks the op or it refuses the shape."""
    try:
        return [tinygemm_int4(p) for p in ps]
    except (RuntimeError, ValueError, AttributeError) as err:
        print(f"<!-- tinygemm unavailable: {type(err).__name__}: {str(err)[:300]} -->", flush=True)
        return []


def _time_config(x, p, w8, cfg):
    try:
        return time_linear([p], x, cfg, w8a8=w8)
    except (RuntimeError, ValueError, AssertionError) as err:
        print(f"<!-- {cfg} failed: {str(err)[:200]} -->")
        return float("nan")


def sweep():
    """Time candidate launches on the largest layer to pick the H200 table."""
    n, k = 28672, 8192
    w = seeded_weight(n, k)
    p4 = quantize_weight(w, "int4", group_size=128)
    p8 = quantize_weight(w, "fp8-block")
    lines = [
        "## Launch sweep (28672 x 8192)",
        "",
        "| weight | M | config | us |",
        "|---|---|---|---|",
    ]

    def sk(bn, bk, split=1, warps=4, stages=3, bm=16):
        return LinearConfig("splitk", bm, bn, bk, split_k=split, num_warps=warps, num_stages=stages)

    def gm(bm, bn, bk, warps, stages, path="gemm"):
        return LinearConfig(path, bm, bn, bk, num_warps=warps, num_stages=stages)

    decode = [
        sk(64, 128, stages=4),
        sk(32, 128),
        sk(128, 128),
        sk(64, 256),
        sk(32, 256),
        sk(64, 128, 2),
        sk(32, 128, warps=2),
    ]
    cands = {
        1: {
            "int4": decode,
            "mxfp4": decode[:6],
            "nvfp4": decode[:6],
            "fp8_w8a8": [sk(64, 128), sk(32, 128, warps=2), sk(128, 128), sk(64, 128, 2)],
            "fp8_w8a16": decode[:6],
        },
        16: {
            "int4": decode[:6],
            "fp8_w8a8": [
                sk(64, 128),
                sk(32, 128, warps=2),
                sk(128, 128),
                sk(64, 128, 2),
                sk(64, 128, stages=4),
            ],
        },
        64: {
            "int4": [
                sk(64, 256, bm=64),
                sk(32, 256, bm=64),
                sk(64, 128, bm=64),
                gm(64, 64, 128, 4, 3),
            ],
            "fp8_w8a8": [sk(64, 128, bm=64), sk(32, 128, bm=64), sk(128, 128, bm=64, warps=8)],
        },
        4096: {
            "int4": [
                gm(128, 128, 64, 8, 3),
                gm(128, 128, 128, 8, 3),
                gm(128, 256, 64, 8, 3),
                gm(64, 128, 128, 4, 3),
                gm(128, 64, 128, 4, 4),
                gm(16, 16, 16, 4, 3, "dequant"),
            ],
            "fp8_w8a8": [
                gm(128, 128, 128, 8, 3),
                gm(128, 128, 128, 4, 4),
                gm(64, 128, 128, 4, 3),
                gm(128, 64, 128, 4, 4),
                gm(256, 128, 128, 8, 3),
                gm(128, 128, 128, 8, 3, "cublas"),
            ],
        },
    }
    payloads = {
        "int4": p4,
        "fp8_w8a8": p8,
        "fp8_w8a16": p8,
        "mxfp4": quantize_weight(w, "mxfp4"),
        "nvfp4": quantize_weight(w, "nvfp4"),
    }
    del w
    for m, per_weight in cands.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for weight, cfgs in per_weight.items():
            for cfg in cfgs:
                us = _time_config(x, payloads[weight], weight == "fp8_w8a8", cfg)
                lines.append(
                    f"| {weight} | {m} | {cfg.path} {cfg.block_m}x{cfg.block_n}x"
                    f"{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages} "
                    f"| {us:.1f} |"
                )
                print(lines[-1], flush=True)
    return "\n".join(lines)


def sweep_gemv():
    """Time GEMV launches for one row on the largest layer."""
    n, k = 28672, 8192
    w = seeded_weight(n, k)
    payloads = {
        s: quantize_weight(w, s, **kw) for s, kw in (*PACKED_4BIT_SCHEMES, ("fp8-block", {}))
    }
    del w
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    lines = ["## GEMV sweep (M = 1, 28672 x 8192)", "", "| weight | config | us |", "|---|---|---|"]
    for name, p in payloads.items():
        for bn, bk, warps in (
            (64, 128, 4),
            (32, 256, 4),
            (128, 128, 8),
            (64, 256, 4),
            (32, 128, 2),
        ):
            cfg = LinearConfig("gemv", 16, bn, bk, num_warps=warps)
            us = _time_config(x, p, False, cfg)
            lines.append(f"| {name} | gemv {bn}x{bk} w{warps} | {us:.1f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time candidate launch configs")
    parser.add_argument("--sweep-gemv", action="store_true", help="time GEMV launches at M=1")
    parser.add_argument("--quick", action="store_true", help="two shapes, three batch sizes")
    args = parser.parse_args()
    out = [header("qlens quantized linear kernels")]
    if args.sweep:
        out.append(sweep())
    if args.sweep_gemv:
        out.append(sweep_gemv())
    rows = []
    shapes = BENCHMARK_LAYERS[::3] if args.quick else BENCHMARK_LAYERS
    for n, k in shapes:
        bench_shape(n, k, (1, 16, 4096) if args.quick else M_VALUES, rows)
    names = list(rows[0][4])
    out += [
        "",
        "## Time (us) and speed-up over bf16 F.linear (same run)",
        "",
        "| M | N | K | W8A16 path | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for m, n, k, path, res in rows:
        cells = [f"{res['bf16']:.1f}"] + [
            f"{res[c]:.1f} ({res['bf16'] / res[c]:.2f}x)" for c in names[1:]
        ]
        out.append(f"| {m} | {n} | {k} | {path} | " + " | ".join(cells) + " |")
    out += ["", "## Weight-stream bandwidth at M=1 (TB/s, bytes of the packed weight)", ""]
    for m, n, k, _, res in rows:
        if m == 1:
            bw = {
                "bf16": 2.0,
                "fp8_w8a8": 1.0 + 4 / 128**2,
                "int4": 0.5 + 4 / 128,
                "tinygemm_int4": 0.5 + 4 / 128,
                "mxfp4": 0.5 + 1 / 32,
                "nvfp4": 0.5 + 1 / 16,
            }
            out.append(
                f"- {n}x{k}: "
                + ", ".join(f"{s} {n * k * b / res[s] / 1e6:.2f}" for s, b in bw.items())
            )
    publish("\n".join(out), "kernels.md")


if __name__ == "__main__":
    main()
