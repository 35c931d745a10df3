"""One-row E2M1 (MXFP4, NVFP4) GEMVs in whole 8B-shape models, bf16 in the same run:
``qlens.StaticDecoder`` (fused step, CUDA graphs) with the graph regrouping each E2M1 row (the
library's choice until 2026-12-06) against reading it as it is (the library's choice since;
``static_decode_host.py``'s columns). The eager
comparison of the earlier one-row launches is in ``tuning/results/e2m1_as_is_e2e_h100.md``.

Run on a CUDA GPU from the repository root: ``python -m benchmarks.tuning.e2m1_as_is_e2e
[--schemes mxfp4,nvfp4] [--reads regrouped,as-is]``;
prints markdown and, when ``$OUT`` is set, writes it to ``$OUT/e2m1_as_is_e2e_static_<gpu>.md``.
"""

from __future__ import annotations

import argparse

import torch

import qlens
import qlens.kernels.ops as ops
from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, publish
from benchmarks.static_decode_host import measure, seeded_prompt, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="mxfp4,nvfp4")
    parser.add_argument(
        "--reads", default="regrouped,as-is", help="graph reads of x to time: regrouped, as-is"
    )
    args = parser.parse_args()
    reads = args.reads.split(",")
    if not set(reads) <= {"regrouped", "as-is"}:
        parser.error(f"--reads takes regrouped and as-is, got {args.reads}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shape = shapes(False, None)["8b"]
    prompt = seeded_prompt(shape, torch.device("cuda"))
    base = build_model(shape, torch.device("cuda"))
    rows = {"bf16": measure(base, prompt, 64, 3)}
    print(table(rows)[-1], flush=True)
    regrouping = ops.REGROUPING_DEVICES
    try:
        for scheme in args.schemes.split(","):
            for as_is in (read == "as-is" for read in reads):
                ops.REGROUPING_DEVICES = frozenset() if as_is else frozenset({"cuda"})
                model = qlens.quantize(base, scheme)
                label = "as it is (library)" if as_is else "regrouped"
                rows[f"{scheme}, graph reads x {label}"] = measure(model, prompt, 64, 3)
                print(table(rows)[-1], flush=True)
                del model
                torch.cuda.empty_cache()
    finally:
        ops.REGROUPING_DEVICES = regrouping
    publish(
        header("One-row E2M1 read as it is, 8B shape (static)", "as static_decode_host.py",
               ["transformers"]) + "\n".join(table(rows)),
        "e2m1_as_is_e2e_static_h200.md",
    )  # fmt: skip


if __name__ == "__main__":
    main()
