"""One-row E2M1 (MXFP4, NVFP4) GEMVs reading ``x`` as it is, in whole 8B-shape models, bf16 in
the same run:

- ``--part eager``: eager ``model.generate`` tokens/s with the one-row launches before the
  E2M1 as-is rule (4-row tiles, unpipelined: the tuned constants set back for the comparison)
  and with it (8-row tiles, 3 stages), int4 for reference;
- ``--part static``: ``qlens.StaticDecoder`` (fused step, CUDA graphs) with the graph
  regrouping each E2M1 row (the library's choice) against reading it as it is with the new
  launches (``static_decode_host.py``'s columns).

Run on a CUDA GPU from the repository root:
``python -m benchmarks.tuning.e2m1_as_is_e2e --part eager`` (then ``--part static``); prints
markdown and, when ``$OUT`` is set, writes it to ``$OUT/e2m1_as_is_e2e_<part>_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import qlens
import qlens.kernels.ops as ops
from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, publish
from benchmarks.e2e_model import PROMPT_TOKENS
from benchmarks.static_decode_host import measure, seeded_prompt, table
from qlens.kernels import configs, launch_tables

NEW_LAUNCH = (launch_tables.E2M1_AS_IS_BLOCK_N, launch_tables.E2M1_AS_IS_STAGES)
OLD_LAUNCH = (launch_tables.Tuned(4, "before the rule"), launch_tables.Tuned(1, "before the rule"))


def use_launches(new: bool) -> None:
    """The one-row E2M1 as-is launches with the rule (``new``) or as before it."""
    launch_tables.E2M1_AS_IS_BLOCK_N, launch_tables.E2M1_AS_IS_STAGES = (
        NEW_LAUNCH if new else OLD_LAUNCH
    )
    configs._table_config.cache_clear()


def eager_tokens_per_s(model: Any, prompt: torch.Tensor, tokens: int) -> float:
    """Greedy ``generate`` of ``tokens`` tokens: median of 3 timed calls after one."""
    mask = torch.ones_like(prompt)

    def run() -> None:
        model.generate(
            input_ids=prompt, attention_mask=mask, pad_token_id=0, max_new_tokens=tokens,
            min_new_tokens=tokens, do_sample=False,
        )  # fmt: skip

    run()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return tokens / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("eager", "static"), required=True)
    parser.add_argument("--tokens", type=int, default=32, help="eager: greedy tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shape = shapes(False, None)["8b"]
    prompt = seeded_prompt(shape, torch.device("cuda"))
    base = build_model(shape, torch.device("cuda"))
    if args.part == "eager":
        lines = ["| model | one-row E2M1 launch | eager tok/s | vs bf16 |", "|---|---|---|---|"]
        bf16 = eager_tokens_per_s(base, prompt, args.tokens)
        lines.append(f"| bf16 | - | {bf16:.1f} | 1.00x |")
        for scheme, new in (("mxfp4", False), ("mxfp4", True), ("nvfp4", False), ("nvfp4", True),
                            ("int4", True)):  # fmt: skip
            use_launches(new)
            model = qlens.quantize(base, scheme)
            speed = eager_tokens_per_s(model, prompt, args.tokens)
            launch = "-" if scheme == "int4" else ("8 rows, 3 stages" if new else "4 rows, 1 stage")
            lines.append(f"| {scheme} | {launch} | {speed:.1f} | {speed / bf16:.2f}x |")
            del model
            torch.cuda.empty_cache()
        use_launches(True)
        timing = f"{args.tokens} greedy tokens after a {PROMPT_TOKENS}-token prompt, eager "
        timing += "model.generate, median of 3 after one"
    else:
        rows = {"bf16": measure(base, prompt, 64, 3)}
        regrouping = ops.REGROUPING_DEVICES
        for scheme in ("mxfp4", "nvfp4"):
            for as_is in (False, True):
                ops.REGROUPING_DEVICES = frozenset() if as_is else regrouping
                model = qlens.quantize(base, scheme)
                label = "as it is" if as_is else "regrouped (library)"
                rows[f"{scheme}, graph reads x {label}"] = measure(model, prompt, 64, 3)
                del model
                torch.cuda.empty_cache()
        ops.REGROUPING_DEVICES = regrouping
        lines = table(rows)
        timing = "as static_decode_host.py"
    title = f"One-row E2M1 read as it is, 8B shape ({args.part})"
    publish(
        header(title, timing, ["transformers"]) + "\n".join(lines),
        f"e2m1_as_is_e2e_{args.part}_h200.md",
    )


if __name__ == "__main__":
    main()
