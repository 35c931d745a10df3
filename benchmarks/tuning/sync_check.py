"""Which calls of an eager quantized forward make the host wait for the GPU: the forward of a
Llama of 1B shape at a short and a long prompt, through ``qlens.load`` and
``run_with_cache``, bf16 against qlens schemes, under ``torch.cuda.set_sync_debug_mode``
(every synchronizing call warns with its stack), with the wall time of the short forward.

Run on a CUDA GPU from the repository root:
``python -m benchmarks.tuning.sync_check --schemes int4,nvfp4``; prints markdown."""

from __future__ import annotations

import argparse
import collections
import os
import traceback
import warnings

import torch

from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import median_wall_s
from benchmarks.e2e_model import for_each_quantized


def _package_dirs() -> tuple[str, ...]:
    """The directories of the qlens and transformers packages (their parents' paths cut)."""
    import transformers

    import qlens

    return tuple(os.path.dirname(p.__file__) + os.sep for p in (qlens, transformers))


def synchronizing_calls(run) -> collections.Counter:
    """Where ``run`` synchronizes: the innermost qlens or transformers frame of each warning."""
    found: collections.Counter = collections.Counter()
    packages = _package_dirs()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f"{os.path.relpath(f.filename, os.path.dirname(os.path.dirname(root)))}:{f.lineno} "
            f"{f.name}"
            for f in traceback.extract_stack()[:-1]
            for root in packages
            if f.filename.startswith(root)
        ]
        found[(str(message)[:60], frames[-1] if frames else f"{filename}:{lineno}")] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def main() -> None:
    import qlens

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="int4,nvfp4")
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--long", type=int, default=2048)
    args = parser.parse_args()
    shape = shapes(False, None)["1b"]
    device = torch.device("cuda")
    base = build_model(shape, device)
    gen = torch.Generator().manual_seed(0)
    vocab = shape.config["vocab_size"]
    short = torch.randint(0, vocab, (1, args.short), generator=gen).to(device)
    long = torch.randint(0, vocab, (1, args.long), generator=gen).to(device)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| model | call | synchronizing calls (message, innermost qlens/transformers frame) |")
    print("|---|---|---|")
    walls = {}

    def run(scheme: str, model: torch.nn.Module) -> None:
        bridge = qlens.load(model)
        calls = {
            f"forward {args.short}": lambda: model(short),
            f"forward {args.long}": lambda: model(long),
            f"run_with_cache {args.short}": lambda: bridge.run_with_cache(
                short, names_filter=lambda n: n.endswith("hook_resid_post")
            ),
            "bridge.generate 4": lambda: bridge.generate(short, 4, stop_at_eos=False),
        }
        with torch.no_grad():
            for name, call in calls.items():
                call()  # warm-up: first-call preparation is not what repeats
                found = synchronizing_calls(call)
                text = "; ".join(f"{n}x {m!r} at {w}" for (m, w), n in found.items()) or "none"
                print(f"| {scheme} | {name} | {text} |", flush=True)
            walls[scheme] = median_wall_s(lambda: model(short), 20, 3)

    with torch.no_grad():
        run("bf16", base)
    for_each_quantized(base, args.schemes.split(","), run)
    print()
    print(f"| model | forward {args.short} ms (median of 20) | vs bf16 |")
    print("|---|---|---|")
    for scheme, wall in walls.items():
        print(f"| {scheme} | {wall * 1e3:.2f} | {wall / walls['bf16']:.2f}x |")


if __name__ == "__main__":
    main()
