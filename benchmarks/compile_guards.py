"""What dynamo checks before every call of a compiled quantized model: its guards.

A compiled forward runs only after dynamo has checked all the guards it installed while tracing
(``TorchDynamo Cache Lookup`` in a profile), on every call: in compiled static-cache decode,
once per token. Each quantized linear adds guards on its payload tensors and on whatever its
traced forward reads. This builds a random-weight Llama of ``--layers`` layers (hidden 256, so
tracing is quick), bf16 and each of ``--schemes`` (``qlens.quantize``), compiles the forward
(``backend="eager"``: the guards do not depend on the backend), and times the guard check
alone (the compiled frame's guard manager called on the call's arguments): the best and the
median of seven rounds of 200 checks. Also counts the guards by kind.

``--hook-guards`` also guards every module's hook dicts, empty ones included, as dynamo does in a
process that has built a ``qlens.Bridge`` (``skip_nnmodule_hook_guards = False``).

Run on any machine: ``PYTHONPATH=. python benchmarks/compile_guards.py [--layers 32]``
(``PYTHONPATH`` names the tree whose qlens is timed); prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/compile_guards_cpu.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import statistics
import sys
import time
from collections import Counter

import torch
from _dynamo_guards import logged_guards
from _timing import publish
from transformers import LlamaConfig, LlamaForCausalLM

import qlens

ROUNDS, CHECKS = 7, 200


def build(scheme: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    return model if scheme == "bf16" else qlens.quantize(model, scheme, inplace=True)


def measure(scheme: str, layers: int) -> tuple[float, float, Counter]:
    """Best and median microseconds of one guard check, and the guards by kind."""
    torch._dynamo.reset()
    model = build(scheme, layers)
    ids = torch.randint(0, 1000, (1, 1))

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, use_cache=False).logits

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    with torch.inference_mode():
        text = logged_guards(lambda: compiled(ids))
        compiled(ids)
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(forward)
        if len(entries) != 1:
            raise RuntimeError(f"expected one compiled entry, got {len(entries)}")
        guards = entries[0].guard_manager
        arguments = {"tokens": ids, "model": model}  # the frame's locals: its closure too
        if not guards.check(arguments):
            raise RuntimeError("the guards fail on the arguments they were built for")
        rounds = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(CHECKS):
                guards.check(arguments)
            rounds.append((time.perf_counter() - start) / CHECKS * 1e6)
    kinds = Counter(re.findall(r"\+- ([A-Z_]+):", text))
    return min(rounds), statistics.median(rounds), kinds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--schemes", default="int4,nvfp4,fp8-block")
    parser.add_argument("--hook-guards", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.hook_guards:
        from qlens.bridge.bridge import guard_compiled_graphs_on_hooks

        guard_compiled_graphs_on_hooks()
    schemes = ["bf16", *args.schemes.split(",")]
    results = {scheme: measure(scheme, args.layers) for scheme in schemes}
    shown = ("TENSOR_MATCH", "NO_TENSOR_ALIASING", "EQUALS_MATCH", "TYPE_MATCH", "DICT_CONTAINS")
    lines = [
        "# Dynamo's guard check before each compiled call",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- command: `PYTHONPATH=. python {' '.join(sys.argv)}`",
        f"- timing: random-weight Llama, {args.layers} layers, hidden 256, compiled forward "
        f"(backend eager) of one token; the guard manager's check alone, best and median of "
        f"{ROUNDS} rounds of {CHECKS}; module hook dicts "
        + ("guarded (as after a Bridge is built)" if args.hook_guards else "not guarded"),
        "",
        "| model | check us (best) | check us (median) | vs bf16 | guards | "
        + " | ".join(shown)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(shown),
    ]
    base = results["bf16"][0]
    for scheme, (best, median, kinds) in results.items():
        lines.append(
            f"| {scheme} | {best:.1f} | {median:.1f} | {best / base:.2f}x | "
            f"{sum(kinds.values())} | " + " | ".join(str(kinds[k]) for k in shown) + " |"
        )
    publish("\n".join(lines), "compile_guards_cpu.md")


if __name__ == "__main__":
    main()
