"""Where a ``qlens.StaticDecoder`` decode's time goes, without ``torch.profiler`` (whose host
events stretch under it): the prompt's wall time (compiled, the default, and eager), and per
decode step the host's time to issue it (the Python call returning, no sync), the GPU's time
to run it (CUDA events around each step: the graph's kernels and the gaps between them) and
the GPU's idle time between steps, with the wall time per token, bf16 against qlens schemes.

Run on a CUDA GPU from the repository root:
``python benchmarks/static_decode_host.py --size 8b --schemes int4,nvfp4,mxfp4``; prints markdown
(and writes it to ``$OUT/static_decode_host_<size>.md`` when ``$OUT`` is set). A step is
host-bound when its host time exceeds its GPU time (the GPU then idles between steps); when
the GPU time exceeds the sum of the kernels' durations, the graph's kernels leave gaps."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402

from benchmarks._e2e_models import Shape, build_model, shapes  # noqa: E402
from benchmarks._timing import header, median_wall_s, publish  # noqa: E402
from benchmarks.e2e_model import PROMPT_TOKENS, for_each_quantized  # noqa: E402


class StepClock:
    """Wraps a decoder's compiled step: host seconds per call, and CUDA events around each
    call (read after the decode, once the device is synchronized)."""

    def __init__(self, step: Callable[[], None]) -> None:
        self.step = step
        self.host: list[float] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        self.step()
        end.record()
        self.host.append(time.perf_counter() - began)
        self.events.append((start, end))

    def summary(self) -> dict[str, float]:
        """Median microseconds a step: host, GPU, and GPU idle before the next step."""
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) * 1e3 for s, e in self.events]
        pairs = zip(self.events[:-1], self.events[1:], strict=True)
        idle = [end.elapsed_time(next_start) * 1e3 for (_, end), (next_start, _) in pairs]
        return {
            "host_us": statistics.median(self.host) * 1e6,
            "gpu_us": statistics.median(gpu),
            "idle_us": statistics.median(idle) if idle else float("nan"),
        }


def seeded_prompt(shape: Shape, device: torch.device) -> torch.Tensor:
    """The decode benchmarks' prompt: ``PROMPT_TOKENS`` random ids of ``shape``'s vocabulary, seed 0."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape.config["vocab_size"], (1, PROMPT_TOKENS), generator=gen)
    return prompt.to(device)


def measure(model: torch.nn.Module, prompt: torch.Tensor, tokens: int, repeats: int) -> dict:
    """Wall microseconds a token over ``repeats`` timed decodes, the prompt's wall time (a
    call producing one token: the prompt's forward, no decode step), compiled and eager, and
    the step clock of one more decode."""
    from qlens.static_decode import StaticDecoder

    torch._dynamo.reset()
    decoder = StaticDecoder(model, prompt.shape[1] + tokens)
    for _ in range(2):  # compiles the step, then the prompt; records the CUDA graphs
        decoder.generate(prompt, tokens, stop_at_eos=False)
    whole = median_wall_s(lambda: decoder.generate(prompt, tokens, stop_at_eos=False), repeats, 0)
    prefill = median_wall_s(lambda: decoder.generate(prompt, 1, stop_at_eos=False), repeats, 0)
    decoder._compile_prefill = False  # the same decoder's prompt, eagerly
    eager_prefill = median_wall_s(
        lambda: decoder.generate(prompt, 1, stop_at_eos=False), repeats, 1
    )
    decoder._compile_prefill = True
    step = decoder._compiled_step()
    clock = StepClock(step)
    decoder._step = clock
    try:
        decoder.generate(prompt, tokens, stop_at_eos=False)
    finally:
        decoder._step = step
    return {
        "wall_us": whole / tokens * 1e6,
        "eager_wall_us": (whole - prefill + eager_prefill) / tokens * 1e6,
        "prefill_ms": prefill * 1e3,
        "eager_prefill_ms": eager_prefill * 1e3,
        "decode_us": (whole - prefill) / (tokens - 1) * 1e6,
        **clock.summary(),
    }


def table(rows: dict[str, dict]) -> list[str]:
    bf16 = rows.get("bf16")
    lines = [
        "| scheme | wall us/token | vs bf16 | compiled prefill ms | eager prefill ms | wall "
        "vs bf16, eager prefills | decode us/token (prefill excluded) | vs bf16 | host us/step "
        "| GPU us/step | GPU idle us between steps | bound by |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(key: str, r: dict) -> str:
        return f"{bf16[key] / r[key]:.2f}x" if bf16 else "-"

    for scheme, r in rows.items():
        bound = "host" if r["host_us"] > r["gpu_us"] else "GPU"
        lines.append(
            f"| {scheme} | {r['wall_us']:.0f} | {ratio('wall_us', r)} | {r['prefill_ms']:.1f} | "
            f"{r['eager_prefill_ms']:.1f} | {ratio('eager_wall_us', r)} | "
            f"{r['decode_us']:.0f} | {ratio('decode_us', r)} | {r['host_us']:.0f} | "
            f"{r['gpu_us']:.0f} | {r['idle_us']:.0f} | {bound} |"
        )
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("1b", "8b"), default="8b")
    parser.add_argument("--schemes", default="int4,nvfp4,mxfp4")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the step clock reads CUDA events)")
    shape = shapes(False, None)[args.size]
    device = torch.device("cuda")
    prompt = seeded_prompt(shape, device)
    base = build_model(shape, device)
    rows: dict[str, dict[str, float]] = {}

    def run(scheme: str, model: torch.nn.Module) -> None:
        rows[scheme] = measure(model, prompt, args.decode_tokens, args.repeats)
        print(table(rows)[-1], flush=True)  # each row as it is measured

    run("bf16", base)

    for_each_quantized(base, args.schemes.split(","), run)
    text = "\n".join(
        [
            header(
                f"qlens.StaticDecoder step: host against GPU, {shape.label}",
                f"{args.decode_tokens} greedy tokens after a {PROMPT_TOKENS}-token prompt; wall: "
                f"median of {args.repeats} decodes after two compiling ones (the prompt "
                "compiled); compiled and eager prefill: median wall of calls producing one "
                "token, the same decoder's prompt compiled, then eager (wall with eager "
                "prefills: the wall less the one, plus the other); per step: medians "
                "over one more decode, host time of the step call (no sync), GPU time between "
                "CUDA events recorded around it, GPU idle time between consecutive steps",
                ["transformers"],
            ),
            *table(rows),
        ]
    )
    publish(text, f"static_decode_host_{args.size}.md")
    return text


if __name__ == "__main__":
    main()
