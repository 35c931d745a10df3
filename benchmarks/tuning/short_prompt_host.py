"""Where the host time of a short quantized forward goes: plain HF forwards of a 32-token prompt
(8B shape), bf16 against each scheme: the wall time, then a ``cProfile`` of a few forwards with
the functions taking the most time of their own (``benchmarks/eager_linear.py`` times single
linear calls; this is the whole model).

Run on a CUDA GPU from the repository root: ``python -m benchmarks.tuning.short_prompt_host
[--schemes int4] [--tokens 32]``; prints markdown and, when ``$OUT`` is set, writes it to
``$OUT/short_prompt_host_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, median_wall_s, publish
from benchmarks.e2e_model import for_each_quantized

TOP = 18
PROFILED_FORWARDS = 5


def profile_lines(model: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    """The wall time of one forward and the functions with the most own time under cProfile."""
    with torch.no_grad():
        for _ in range(3):
            model(tokens, use_cache=False)
        wall = median_wall_s(lambda: model(tokens, use_cache=False), 20, 1) * 1e6
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(PROFILED_FORWARDS):
            model(tokens, use_cache=False)
        torch.cuda.synchronize()
        profiler.disable()
    stats = pstats.Stats(profiler)
    lines = [f"wall {wall:.0f} us a forward (median of 20)", ""]
    lines += ["| function | calls a forward | own us a forward | cumulative us a forward |"]
    lines += ["|---|---|---|---|"]
    entries = stats.stats  # type: ignore[attr-defined]
    rows = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)
    for (path, line, name), (_, calls, own, cumulative, _) in rows[:TOP]:
        where = f"{path.rsplit('/', 1)[-1]}:{line}" if line else path
        lines.append(
            f"| `{name}` ({where}) | {calls / PROFILED_FORWARDS:.0f} | "
            f"{own / PROFILED_FORWARDS * 1e6:.0f} | {cumulative / PROFILED_FORWARDS * 1e6:.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="int4")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shape = shapes(False, None)["8b"]
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.config["vocab_size"], (1, args.tokens), generator=gen)
    tokens = tokens.to(device)
    base = build_model(shape, device)
    sections: list[str] = []

    def run(scheme: str, model: torch.nn.Module) -> None:
        section = [f"## {scheme}", "", *profile_lines(model, tokens), ""]
        sections.extend(section)
        print("\n".join(section), flush=True)

    run("bf16", base)
    for_each_quantized(base, args.schemes.split(","), run)
    text = header(
        f"Host time of a {args.tokens}-token forward, {shape.label}",
        f"plain HF forward, no cache; wall: median of 20 after warm-up; cProfile over "
        f"{PROFILED_FORWARDS} forwards, per forward",
        ["transformers"],
    ) + "\n".join(sections)
    publish(text, "short_prompt_host_h200.md")


if __name__ == "__main__":
    main()
