"""Where a ``StaticDecoder``'s compiled 32-token prompt spends its time, bf16 against qlens
schemes (``benchmarks/static_decode_host.py`` times it whole: 10.6 ms for bf16, 30.6-30.7 ms
quantized on an H100).

Per scheme, after the decoder compiled and recorded its graphs: the wall time of a call that
produces one token (the prompt's forward and nothing else), the host time of its parts with a
device sync after each (the payload check, the decode state's preparation, the compiled
prompt forward), then ``torch.profiler`` over a few such calls: the GPU's busy time, the
kernels launched, and the host operators with the most time of their own.

Run on a CUDA GPU from the repository root:
``python -m benchmarks.tuning.prompt_profile [--size 8b] [--schemes int4,nvfp4]``; prints
markdown (and writes it to ``$OUT/prompt_profile_<gpu>.md`` when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, median_wall_s, publish
from benchmarks.e2e_model import for_each_quantized
from benchmarks.static_decode_host import seeded_prompt

PROFILED_CALLS = 5
TOP = 10
PARTS = ("_check_payloads", "_prepare", "_prompt_forward", "_commit")


def part_times(decoder: object, call: Callable[[], object], rounds: int = 5) -> dict[str, float]:
    """Median milliseconds of each part of ``call``, each wrapped with device syncs."""
    spent: dict[str, list[float]] = defaultdict(list)
    originals = {name: getattr(decoder, name) for name in PARTS}

    def timed(name: str, method: Callable[..., object], *args: object, **kwargs: object) -> object:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = method(*args, **kwargs)
        torch.cuda.synchronize()
        spent[name].append((time.perf_counter() - start) * 1e3)
        return out

    for name, method in originals.items():
        setattr(decoder, name, functools.partial(timed, name, method))
    try:
        for _ in range(rounds):
            call()
    finally:
        for name in originals:
            delattr(decoder, name)
    return {name: sorted(times)[len(times) // 2] for name, times in spent.items()}


def profile(call: Callable[[], object]) -> tuple[float, int, list[tuple[str, int, float]]]:
    """GPU busy ms a call, kernels a call, and the host ops with the most self time a call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            call()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / PROFILED_CALLS
    launches = sum(e.count for e in kernels) // PROFILED_CALLS
    host = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    top = [
        (e.key, e.count // PROFILED_CALLS, e.self_cpu_time_total / 1e3 / PROFILED_CALLS)
        for e in host[:TOP]
    ]
    return busy, launches, top


def measure(scheme: str, model: torch.nn.Module, prompt: torch.Tensor) -> list[str]:
    from qlens.static_decode import StaticDecoder

    torch._dynamo.reset()
    decoder = StaticDecoder(model, prompt.shape[1] + 8)

    def one_token() -> object:
        return decoder.generate(prompt, 1, stop_at_eos=False)

    for _ in range(2):  # compiles and records the step, then the prompt
        decoder.generate(prompt, 4, stop_at_eos=False)
    wall = median_wall_s(one_token, 10, 2) * 1e3
    parts = part_times(decoder, one_token)
    busy, launches, top = profile(one_token)
    lines = [
        f"### {scheme}: wall {wall:.2f} ms a one-token call; GPU busy {busy:.2f} ms; "
        f"{launches} kernels",
        "",
        "parts (synced, median ms): "
        + ", ".join(f"`{name}` {ms:.2f}" for name, ms in parts.items()),
        "",
        "| host op | calls a call | self ms a call |",
        "|---|---|---|",
        *(f"| `{key[:90]}` | {count} | {ms:.2f} |" for key, count, ms in top),
        "",
    ]
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("1b", "8b"), default="8b")
    parser.add_argument("--schemes", default="int4,nvfp4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda")
    shape = shapes(False, None)[args.size]
    base = build_model(shape, device)
    prompt = seeded_prompt(shape, device)
    lines = measure("bf16", base, prompt)

    def run(scheme: str, model: torch.nn.Module) -> None:
        lines.extend(measure(scheme, model, prompt))

    for_each_quantized(base, args.schemes.split(","), run)
    timing = (
        f"random-weight Llama ({args.size}), StaticDecoder (compiled prompt and step); a "
        "one-token call of generate: median wall of 10 after 2; parts: each wrapped in device "
        f"syncs, median of 5; torch.profiler over {PROFILED_CALLS} calls, per call"
    )
    publish("\n".join([header("Compiled prompt profile", timing), *lines]), "prompt_profile.md")


if __name__ == "__main__":
    main()
