"""What a one-row GEMV's K loop executes (the packed 4-bit and the byte-wise kernels), counted
in its sm_90 SASS, for the launch the H200 tables give each 8B decode layer and scheme. No GPU
is needed (Triton compiles for sm_90 on any machine), so kernels can be compared before they
are timed. The one-row packed GEMV is bound by instruction issue (``results/kernels_notes.md``
items 28 and 33): fewer instructions a code and no shared-memory exchange in the loop are what
a change must show here first.

Run from the repository root, without ``TRITON_INTERPRET``:
``python -m benchmarks.tuning.gemv_sass [--schemes int4,mxfp4,nvfp4,fp8-block]``; prints
markdown.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections import Counter

import torch
import triton

from benchmarks._sm90 import (
    barriers,
    compile_for_sm90,
    cuobjdump,
    nvidia_tools,
    record_launches,
    sass_loops,
    stack_bytes,
)
from benchmarks._timing import DECODE_LAYERS_8B, launch_label
from benchmarks.tuning.gemv_tiles import one_row_launch

SHARED_MEMORY_OPS = ("STS", "LDS", "LDSM", "BAR")


def recorded_launch(scheme: str, n: int, k: int) -> tuple:
    """The GEMV launch (kernel, arguments, options) the H200 tables give one row of ``x`` as it
    is on an ``[n, k]`` weight, recorded instead of run (CPU tensors stand in)."""
    from qlens.kernels.plan import LinearPlan
    from qlens.quant.quantize import quantize_weight

    recorded = record_launches()
    options = {"group_size": 128} if scheme == "int4" else {}
    payload = quantize_weight(torch.randn(n, k), scheme, **options)
    LinearPlan(payload, torch.device("cpu"), route="kernel")(
        torch.randn(1, k, dtype=torch.bfloat16)
    )
    (launch,) = recorded
    return launch


def loop_row(scheme: str, n: int, k: int, tools: str) -> str:
    kernel, args, options = recorded_launch(scheme, n, k)
    compiled = compile_for_sm90(kernel, args, options)
    (loop,) = sass_loops(cuobjdump(compiled, tools, "--dump-sass"))
    codes = options["BLOCK_N"] * options["BLOCK_K"] // (32 * options["num_warps"])
    total = sum(loop.values())
    shared = sum(v for op, v in loop.items() if op.split(".")[0] in SHARED_MEMORY_OPS)
    top = ", ".join(f"{op} {v}" for op, v in Counter(loop).most_common(6))
    label = launch_label(
        one_row_launch(
            options["BLOCK_N"], options["BLOCK_K"], options["num_warps"], options["LOOP_STAGES"]
        )
    )
    return (
        f"| {n} x {k} | {scheme} | {label} | {stack_bytes(compiled, tools)} | {barriers(compiled)} | "
        f"{total} | {codes} | {total / codes:.2f} | {shared} | {top} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemes", default="int4,mxfp4,nvfp4")
    args = parser.parse_args()
    tools = nvidia_tools()
    if tools is None:
        sys.exit("Triton's NVIDIA backend tools (ptxas, cuobjdump) are missing")
    lines = [
        "# One-row GEMVs' K loops in sm_90 SASS",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- compiled on the CPU for sm_90: triton {triton.__version__}, torch {torch.__version__},"
        f" Python {platform.python_version()}",
        f"- command: `{' '.join(['python -m benchmarks.tuning.gemv_sass', *sys.argv[1:]])}`",
        "- counted: the instructions of the K loop's body in the SASS (one K step: codes a thread"
        " = rows x K / threads); stack: bytes spilled a thread; barriers: in the whole PTX",
        "",
        "| N x K | scheme | launch | stack bytes | barriers | loop instructions | codes a thread "
        "| instructions a code | shared-memory ops in the loop | most frequent |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scheme in args.schemes.split(","):
        for n, k in DECODE_LAYERS_8B:
            lines.append(loop_row(scheme, n, k, str(tools)))
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
