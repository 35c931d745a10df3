"""Where an eager decode step's host time goes: bf16 and quantized copies of one model, all
resident, each stepping one token at a time against a KV cache (as ``generate`` does), with the
wall time a step, the GPU's busy time a step, and cProfile's functions by own time.

Run on a CUDA GPU: ``python -m benchmarks.tuning.decode_step_profile [--size moe|8b|1b]
[--schemes int4,fp8-block]``; prints markdown and, when ``$OUT`` is set, writes it to
``$OUT/decode_step_profile_<size>_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, median_wall_s, publish

PROMPT_TOKENS = 32
STEPS = 32
TOP = 18


def decode_steps(model: nn.Module, prompt: torch.Tensor, steps: int, sync_each: bool) -> float:
    """Seconds per step of ``steps`` greedy one-token steps after ``prompt``'s prefill, the GPU
    synchronized after each step (``sync_each``, as ``generate``'s stopping check does) or once."""
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def gpu_busy_us(model: nn.Module, prompt: torch.Tensor) -> tuple[float, int]:
    """GPU-busy microseconds and GPU operations of one decode step."""
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    model(token, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(token, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in events), len(events)


def host_profile(call: Callable[[], object]) -> dict[str, tuple[float, float, float]]:
    """cProfile of ``call``: each function's (calls, own seconds, total seconds)."""
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    functions = {}
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{path.rsplit('site-packages/', 1)[-1].rsplit('/work/', 1)[-1]}:{line}({name})"
        functions[where] = (calls, own, cum)
    return functions


def profile_table(functions: dict[str, tuple[float, float, float]], per: int) -> str:
    """The ``TOP`` functions by own time, per step (``per`` steps profiled)."""
    rows = sorted(functions.items(), key=lambda kv: -kv[1][1])[:TOP]
    lines = ["| function | calls a step | own us a step | total us a step |", "|---|---|---|---|"]
    for where, (calls, own, cum) in rows:
        lines.append(
            f"| `{where[-90:]}` | {calls / per:.1f} | {own / per * 1e6:.0f} | {cum / per * 1e6:.0f} |"
        )
    total = sum(f[1] for f in functions.values()) / per * 1e6
    return f"Python and C calls under cProfile: {total:.0f} us a step\n\n" + "\n".join(lines)


def difference_table(
    mine: dict[str, tuple[float, float, float]],
    base: dict[str, tuple[float, float, float]],
    per: int,
) -> str:
    """The ``TOP`` functions whose own time a step differs most from ``base``'s."""
    names = set(mine) | set(base)
    empty = (0.0, 0.0, 0.0)
    diff = {n: (mine.get(n, empty), base.get(n, empty)) for n in names}
    rows = sorted(diff.items(), key=lambda kv: -abs(kv[1][0][1] - kv[1][1][1]))[:TOP]
    lines = [
        "| function | calls a step | bf16 calls a step | own us a step | bf16 own us a step |",
        "|---|---|---|---|---|",
    ]
    for where, (m, b) in rows:
        lines.append(
            f"| `{where[-90:]}` | {m[0] / per:.1f} | {b[0] / per:.1f} | {m[1] / per * 1e6:.0f} | "
            f"{b[1] / per * 1e6:.0f} |"
        )
    return "\n".join(lines)


def decode_loop(model: nn.Module, prompt: torch.Tensor) -> Callable[[], object]:
    """``STEPS`` one-token steps after a fresh prefill of ``prompt``."""
    return lambda: decode_steps(model, prompt, STEPS, sync_each=False)


def generate(model: nn.Module, prompt: torch.Tensor) -> Callable[[], object]:
    """HF ``generate`` of ``STEPS`` greedy tokens after ``prompt``."""
    return lambda: model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), pad_token_id=0,
        do_sample=False, max_new_tokens=STEPS, min_new_tokens=STEPS,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("1b", "8b", "moe"), default="moe")
    parser.add_argument("--schemes", default="int4,fp8-block")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import qlens

    shape = shapes(False, None)[args.size]
    device = torch.device("cuda")
    base = build_model(shape, device)
    models = {"bf16": base}
    for scheme in args.schemes.split(","):
        models[scheme] = qlens.quantize(base, scheme)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape.config["vocab_size"], (1, PROMPT_TOKENS), generator=gen)
    prompt = prompt.to(device)
    names = list(models)
    kinds = ("synced", "one sync", "generate")
    walls: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in names}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                model = models[name]
                seconds = {
                    "synced": decode_steps(model, prompt, STEPS, sync_each=True),
                    "one sync": decode_steps(model, prompt, STEPS, sync_each=False),
                    "generate": median_wall_s(generate(model, prompt), 1, 0) / STEPS,
                }
                if round_:
                    for kind in kinds:
                        walls[name][kind].append(seconds[kind])

        def paired(name: str, kind: str) -> float:
            pairs = zip(walls[name][kind], walls["bf16"][kind], strict=True)
            return statistics.median(m / b for m, b in pairs)

        lines = [
            "| model | step us, synced each step | step us, one sync | generate us a token | "
            "time vs bf16: synced, one sync, generate (paired) | GPU busy us a step | "
            "GPU ops a step |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in names:
            busy, ops = gpu_busy_us(models[name], prompt)
            us = [statistics.median(walls[name][k]) * 1e6 for k in kinds]
            ratios = ", ".join(f"{paired(name, k):.3f}x" for k in kinds)
            lines.append(
                f"| {name} | {us[0]:.0f} | {us[1]:.0f} | {us[2]:.0f} | {ratios} | {busy:.0f} | "
                f"{ops} |"
            )
        sections = []
        for label, make in (("decode loop", decode_loop), ("generate", generate)):
            profiles = {}
            for name in names:
                make(models[name], prompt)()  # warm
                profiles[name] = host_profile(make(models[name], prompt))
                sections.append(f"### {name}, {label}\n\n{profile_table(profiles[name], STEPS)}\n")
            for name in names[1:]:
                sections.append(
                    f"### {name} against bf16, {label}\n\n"
                    f"{difference_table(profiles[name], profiles['bf16'], STEPS)}\n"
                )
    timing = (
        f"{STEPS} one-token steps after a {PROMPT_TOKENS}-token prefill, plain HF forward with "
        f"a DynamicCache; wall medians over {args.rounds} rounds (order rotated); paired ratio "
        "a median of per-round ratios; GPU busy from torch.profiler over one step; host "
        f"profile: cProfile over {STEPS} steps"
    )
    text = header(f"Decode step profile, {shape.label}", timing, ["transformers"])
    text += "\n".join(lines) + "\n\n" + "\n".join(sections)
    publish(text, f"decode_step_profile_{args.size}_h200.md")


if __name__ == "__main__":
    main()
