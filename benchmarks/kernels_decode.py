"""W4A16 decode (M = 1 and 16) against bf16 ``F.linear`` and gemlite, with launch sweeps and parity.

Both GEMV kernels of qlens are timed in the same run, each on the dispatcher's launch: the
word-wise one (the default for these weights: int32 words of eight codes, integer decodes) and
the byte-wise one (``LinearConfig(words=False)``). gemlite (int4, group 128,
its own autotuning) is timed when it is importable.

Run on a CUDA GPU: ``python benchmarks/kernels_decode.py [--no-sweep]``; prints markdown and,
when ``$OUT`` is set, writes it to ``$OUT/kernels_decode_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from _timing import (
    BENCHMARK_LAYERS,
    PACKED_4BIT_SCHEMES,
    header,
    launch_label,
    publish,
    rel_err,
    rotation,
    seeded_weight,
    time_bf16_linear,
    time_graph,
    time_linear,
)

from qlens.kernels import LinearConfig, dequantize_triton, quantized_linear
from qlens.kernels.configs import split_k_for
from qlens.kernels.dispatch import default_config
from qlens.quant.quantize import quantize_weight

BYTES_PER_WEIGHT = {"int4": 0.5 + 4 / 128, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
COPY_TBPS = 4.27  # device-to-device copy ceiling measured on this H200 (DESIGN.md section 5)
# Word-wise GEMV launches swept on the largest layer: (M, BLOCK_N, BLOCK_K, warps).
# At M = 1, BLOCK_K = 1024 * warps puts the warps side by side along K, so that x takes the
# words' layout (each thread reuses its x registers for all its rows).
SWEEP = tuple((1, *t) for t in (
    (1, 4096, 4), (2, 4096, 4), (4, 4096, 4), (8, 4096, 4), (2, 2048, 2), (4, 2048, 2),
    (8, 1024, 1), (4, 1024, 1),
)) + tuple((16, *t) for t in ((64, 128, 4), (128, 128, 4)))  # fmt: skip


def _safe(what: str, fn: Callable[[], float]) -> float:
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError, AssertionError, ImportError) as err:
        print(f"<!-- {what} failed: {str(err)[:300]} -->", flush=True)
        return float("nan")


def _launch(m: int, n: int, k: int, bn: int, bk: int, warps: int) -> LinearConfig:
    """A GEMV launch with the dispatcher's K split for these tiles on the GPU."""
    cfg = LinearConfig("gemv", 16, bn, bk, num_warps=warps)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return replace(cfg, split_k=split_k_for(m, n, k, cfg, sms))


def gemlite_int4(p, n: int, k: int):
    """A gemlite int4 layer (group 128, bf16) holding the codes and scales of payload ``p``."""
    from gemlite import DType, GemLiteLinear

    codes = torch.stack((p.data & 0xF, p.data >> 4), dim=-1).view(n, k)
    scales = p.scales.to(torch.bfloat16)
    layer = GemLiteLinear(
        4, group_size=128, in_features=k, out_features=n, input_dtype=DType.BF16,
        output_dtype=DType.BF16,
    )  # fmt: skip
    layer.pack(codes, scales, torch.full_like(scales, 8.0), None)
    return layer


def gemlite_layers(ps, n: int, k: int) -> list:
    """gemlite layers for the int4 payloads ``ps``, or none when gemlite is absent or refuses."""
    try:
        return [gemlite_int4(p, n, k) for p in ps]
    except Exception as err:  # noqa: BLE001 - gemlite raises bare Exception when it refuses
        print(f"<!-- gemlite unavailable: {type(err).__name__}: {str(err)[:300]} -->", flush=True)
        return []


def bench(sweep: bool, dev: torch.device) -> str:
    rows, checks, sweep_rows = [], [], []
    for n, k in BENCHMARK_LAYERS:
        w = seeded_weight(n, k, dev)
        bf16 = rotation(w)
        payloads = {s: rotation(quantize_weight(w, s, **kw)) for s, kw in PACKED_4BIT_SCHEMES}
        layers = gemlite_layers(payloads["int4"], n, k)
        for m in (1, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = _safe("bf16", lambda x=x, b=bf16: time_bf16_linear(b, x))
            cells = {}
            for s, _ in PACKED_4BIT_SCHEMES:
                ps = payloads[s]
                ref = F.linear(x.float(), dequantize_triton(ps[0], torch.float32))
                for label, on in (("byte", False), ("word", True)):
                    c = default_config(ps[0], m, dev, words=on)
                    cells[f"{s} {label}"] = _safe(
                        f"{s} {label} {m}x{n}x{k}",
                        lambda ps=ps, x=x, c=c: time_linear(ps, x, c),
                    )
                    err = _safe(f"{s} {label} parity", lambda p=ps[0], x=x, r=ref, c=c: rel_err(
                        quantized_linear(x, p, config=c), r))  # fmt: skip
                    checks.append((f"{s} {label}", m, n, k, launch_label(c), err))
            if layers:
                cells["gemlite int4"] = _safe(
                    "gemlite", lambda x=x, gs=layers: time_graph([lambda g=g: g(x) for g in gs])
                )
                ref = F.linear(x.float(), dequantize_triton(payloads["int4"][0], torch.float32))
                checks.append(("gemlite int4", m, n, k, "its own", _safe("gemlite parity",
                    lambda x=x, r=ref, g=layers[0]: rel_err(g(x), r))))  # fmt: skip
            rows.append((m, n, k, base, cells))
            print(f"<!-- {m}x{n}x{k} bf16={base:.1f} {cells} -->", flush=True)
        if sweep and (n, k) == BENCHMARK_LAYERS[-1]:
            for (s, _), (m, bn, bk, warps) in itertools.product(PACKED_4BIT_SCHEMES, SWEEP):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                c = _launch(m, n, k, bn, bk, warps)
                us = _safe(f"sweep {s} {c}", lambda ps=payloads[s], c=c, x=x: time_linear(ps, x, c))
                sweep_rows.append((s, m, bn, bk, warps, c.split_k, us))
                print(f"<!-- sweep {s} M={m} {bn}x{bk} w{warps}: {us:.1f} -->", flush=True)
        del bf16, payloads, w, layers
        torch.cuda.empty_cache()
    return render(rows, checks, sweep_rows)


def _cell(us: float, base: float) -> str:
    return f"{us:.1f} ({base / us:.2f}x)"


def render(rows, checks, sweep_rows) -> str:
    out = [header("W4A16 decode on the H200"), "## Time (us) and speed-up over bf16 F.linear", ""]
    out += [
        "Each scheme on the byte-wise and the word-wise kernels, each on the dispatcher's launch "
        "for it (listed in the parity table; M = 16: the word-wise GEMV on tensor cores, the "
        "byte-wise weight on split-K). "
        "% of copy: the 4-bit weight and its scales streamed once, against "
        f"{COPY_TBPS} TB/s.",
        "",
        "| M | N | K | bf16 | int4 byte | int4 word | mxfp4 byte | mxfp4 word | "
        "nvfp4 byte | nvfp4 word | gemlite int4 | best % of copy (int4 / mxfp4 / nvfp4) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, n, k, base, cells in rows:
        times = [
            _cell(cells[f"{s} {v}"], base) for s, _ in PACKED_4BIT_SCHEMES for v in ("byte", "word")
        ]
        gl = _cell(cells["gemlite int4"], base) if "gemlite int4" in cells else "n/a"
        bw = [
            n * k * BYTES_PER_WEIGHT[s] / min(cells[f"{s} byte"], cells[f"{s} word"]) / 1e6
            for s, _ in PACKED_4BIT_SCHEMES
        ]
        shares = " / ".join(f"{100 * b / COPY_TBPS:.0f}%" for b in bw)
        out.append(f"| {m} | {n} | {k} | {base:.1f} | " + " | ".join(times) +
                   f" | {gl} | {shares} |")  # fmt: skip
    if sweep_rows:
        out += [
            "",
            f"## Word-wise GEMV sweep, {BENCHMARK_LAYERS[-1][0]} x {BENCHMARK_LAYERS[-1][1]}",
            "",
        ]
        out += [
            "| weight | M | BLOCK_N x BLOCK_K | warps | split | us |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {s} | {m} | {bn}x{bk} | {w} | {sp} | {us:.1f} |"
            for s, m, bn, bk, w, sp, us in sweep_rows
        ]
    out += ["", "## Parity: relative Frobenius error vs dequantize (fp32) + F.linear", ""]
    out += ["| kernel | M | N | K | launch | rel err |", "|---|---|---|---|---|---|"]
    out += [f"| {s} | {m} | {n} | {k} | {c} | {e:.2e} |" for s, m, n, k, c, e in checks]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch sweep")
    args = parser.parse_args()
    publish(bench(not args.no_sweep, torch.device("cuda")), "kernels_decode_h200.md")


if __name__ == "__main__":
    main()
