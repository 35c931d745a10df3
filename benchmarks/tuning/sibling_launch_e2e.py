"""Eager decode of whole quantized models with q/k/v and gate/up sharing one launch, and with
each projection launching on its own (``qlens.modules.siblings``).

A decode step of a Llama layer launches one GEMV per projection: seven a layer. Sharing the
siblings' launches leaves four, so a step of the 8B shape launches 96 fewer kernels, each
costing the host about what a bf16 ``F.linear`` does. Each variant's model is decoded against
bf16 in back-to-back pairs (``benchmarks.tuning._paired_decode``).

Run on a CUDA GPU: ``python -m benchmarks.tuning.sibling_launch_e2e [--sizes 1b,8b]
[--schemes int4,nvfp4,fp8-block]``; prints markdown and, when ``$OUT`` is set, writes it to
``$OUT/sibling_launch_e2e_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import contextlib

from benchmarks.tuning._paired_decode import (
    Variant,
    no_change,
    paired_decode_rows,
    publish_paired_decode,
)
from qlens.modules.siblings import ungroup_siblings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1b,8b")
    parser.add_argument("--schemes", default="int4,nvfp4,fp8-block")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    variants: list[Variant] = [
        ("shared launches", contextlib.nullcontext, no_change),
        ("one launch each", contextlib.nullcontext, ungroup_siblings),
        ("shared launches (again)", contextlib.nullcontext, no_change),
    ]
    rows = paired_decode_rows(
        args.sizes.split(","), args.schemes.split(","), variants, args.repeats
    )
    publish_paired_decode(
        "Eager decode with sibling projections sharing one launch, and without",
        rows,
        "sibling_launch_e2e_h200.md",
    )


if __name__ == "__main__":
    main()
