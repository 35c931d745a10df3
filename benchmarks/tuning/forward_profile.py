"""Where a quantized forward's time goes: plain HF forwards of a long and a short input
(the 8B shape: 2048 and 32 tokens; the MoE: 1024 and 1), bf16 against each scheme, with the
wall time, the GPU's busy time from torch's profiler (their difference is time the GPU waited
on the host), the kernels of the long forward and the CUDA runtime calls of each (syncs,
copies, launches).

Run on a CUDA GPU: ``python -m benchmarks.tuning.forward_profile [--size 8b|moe]
[--schemes int4,nvfp4]``; prints markdown and, when ``$OUT`` is set, writes it to
``$OUT/forward_profile_<size>_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, median_wall_s, publish
from benchmarks.e2e_model import for_each_quantized

TOP = 12
SHORT_TOKENS = {"8b": 32, "moe": 1}


def kernel_times(
    model: torch.nn.Module, tokens: torch.Tensor, runs: int = 3
) -> tuple[dict[str, float], dict[str, float]]:
    """Per forward, over ``runs`` forwards: microseconds of GPU time of each kernel name, and how
    many times the host called each CUDA runtime or driver function (syncs, copies, mallocs)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            model(tokens, use_cache=False)
        torch.cuda.synchronize()
    kernels: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:90]] += event.device_time_total / runs
        elif event.name.startswith("cu"):
            calls[event.name] += 1 / runs
    return dict(kernels), dict(calls)


def busy_line(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[str, dict, dict]:
    """Wall and GPU-busy time of one forward of ``tokens``, with its kernels and runtime calls."""
    with torch.no_grad():
        for _ in range(2):
            model(tokens, use_cache=False)
        wall = median_wall_s(lambda: model(tokens, use_cache=False), 5, 1) * 1e6
        times, calls = kernel_times(model, tokens)
    busy = sum(times.values())
    line = (
        f"{tokens.shape[1]} tokens: wall {wall:.0f} us, GPU busy {busy:.0f} us ({busy / wall:.0%})"
    )
    return line, times, calls


def describe(name: str, model: torch.nn.Module, tokens: torch.Tensor, short: int) -> list[str]:
    """The long forward's line, kernels and runtime calls, and the short forward's line."""
    short_line, _, short_calls = busy_line(model, tokens[:, :short])
    line, times, calls = busy_line(model, tokens)
    busy = sum(times.values())
    short_runtime = sorted(short_calls.items(), key=lambda kv: -kv[1])[:8]
    lines = [
        f"### {name}: {line}; {short_line}",
        "",
        "| kernel | us per forward | share of busy |",
        "|---|---|---|",
    ]
    for kernel, t in sorted(times.items(), key=lambda kv: -kv[1])[:TOP]:
        lines.append(f"| `{kernel}` | {t:.0f} | {t / busy:.1%} |")
    runtime = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
    lines += [
        "",
        f"runtime calls, {tokens.shape[1]} tokens: "
        + ", ".join(f"{k} {v:.0f}" for k, v in runtime),
        f"runtime calls, {short} tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in short_runtime),
    ]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SHORT_TOKENS), default="8b")
    parser.add_argument("--schemes", default="int4,nvfp4")
    args = parser.parse_args()
    shape = shapes(False, None)[args.size]
    short = SHORT_TOKENS[args.size]
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.config["vocab_size"], (1, shape.prefill_tokens), generator=gen)
    tokens = tokens.to(device)
    base = build_model(shape, device)
    lines = [
        header(
            f"Forward profile, {shape.label}, {shape.prefill_tokens} and {short} tokens",
            "plain HF forward, no cache; wall: median of 5 after warm-up; kernels and runtime "
            "calls: torch.profiler over 3 forwards, per forward",
            ["transformers"],
        )
    ]
    lines += describe("bf16", base, tokens, short)
    print("\n".join(lines), flush=True)

    def run(scheme: str, model: torch.nn.Module) -> None:
        lines.extend(describe(scheme, model, tokens, short))
        print("\n".join(lines[-TOP - 8 :]), flush=True)

    for_each_quantized(base, args.schemes.split(","), run)
    publish("\n".join(lines), f"forward_profile_{args.size}_h200.md")


if __name__ == "__main__":
    main()
