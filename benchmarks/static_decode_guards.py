"""Dynamo's guard check in a ``qlens.StaticDecoder`` decode: host time a step, bf16 against qlens
schemes.

Each compiled step runs only after dynamo's cache lookup (``TorchDynamo Cache Lookup`` in a
profile). ``StaticDecoder`` checks every guard at a call's first step and only the guards that
tell cached graphs apart at the others (``skip_guard_eval_unsafe``). This builds a random-weight
Llama of ``--layers`` layers (hidden 128, so compiling is quick), bf16 and each of ``--schemes``
(``qlens.quantize``), decodes ``--tokens`` greedy tokens with a compiled step (backend
``aot_eager``: the guards do not depend on the backend) after two compiling calls, and reports
the median cache lookup of the first steps (every guard) and of the others, from
``torch.profiler`` over three more calls.

Run on any machine: ``PYTHONPATH=. python benchmarks/static_decode_guards.py [--layers 32]``
(``PYTHONPATH`` names the tree whose qlens is timed); prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/static_decode_guards_cpu.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys

import torch
from _timing import publish
from transformers import LlamaConfig, LlamaForCausalLM

import qlens
from qlens.static_decode import StaticDecoder

CALLS = 3
LOOKUP = "TorchDynamo Cache Lookup"


def build(scheme: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model if scheme == "bf16" else qlens.quantize(model, scheme, inplace=True)


def measure(scheme: str, layers: int, tokens: int) -> tuple[float, float]:
    """Median microseconds of a call's first step's cache lookup and of the others'."""
    torch._dynamo.reset()
    model = build(scheme, layers)
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    decoder = StaticDecoder(model, prompt.shape[1] + tokens, backend="aot_eager")
    for _ in range(2):  # compiles
        decoder.generate(prompt, tokens, stop_at_eos=False)
    first, others = [], []
    for _ in range(CALLS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decoder.generate(prompt, tokens, stop_at_eos=False)
        lookups = sorted(
            (e.time_range.start, e.cpu_time_total) for e in prof.events() if e.name == LOOKUP
        )
        first.append(lookups[0][1])
        others += [us for _, us in lookups[1:]]
    return statistics.median(first), statistics.median(others)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--schemes", default="int4,nvfp4,fp8-block")
    args = parser.parse_args()
    rows = {s: measure(s, args.layers, args.tokens) for s in ["bf16", *args.schemes.split(",")]}
    bf16 = rows["bf16"][1]
    lines = [
        "# Dynamo's cache lookup a StaticDecoder step",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- CPU: {platform.machine()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- command: `PYTHONPATH=. python benchmarks/static_decode_guards.py {' '.join(sys.argv[1:])}`",
        f"- timing: random-weight Llama, {args.layers} layers, hidden 128, {args.tokens} greedy "
        f"tokens after an 8-token prompt, compiled step (aot_eager); `{LOOKUP}` under "
        f"torch.profiler over {CALLS} calls after two compiling ones, medians",
        "",
        "| model | first step of a call, us (every guard) | other steps, us | other steps vs bf16 |",
        "|---|---|---|---|",
    ]
    for scheme, (first, other) in rows.items():
        lines.append(f"| {scheme} | {first:.0f} | {other:.0f} | {other / bf16:.2f}x |")
    publish("\n".join(lines), "static_decode_guards_cpu.md")


if __name__ == "__main__":
    main()
