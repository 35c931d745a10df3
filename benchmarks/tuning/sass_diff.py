"""Whether a change alters the packed 4-bit kernels' machine code: the sm_90 SASS of the
launches the dispatcher prepares (one row, 16 rows on tensor cores and their split reduction, q/k/v
sharing one launch, one token's routed experts) for int4, MXFP4 and NVFP4 on the 8B decode
shapes, dumped at one commit and compared with another's. No GPU is needed (Triton compiles for
sm_90 on any machine): a refactor whose launches compile to the same SASS cannot change their
speed, and one that does shows where.

Run from the repository root, without ``TRITON_INTERPRET``: ``git worktree add /tmp/before
<commit>``, ``python -m benchmarks.tuning.sass_diff --dump before.json --qlens-from
/tmp/before`` (qlens imported from that checkout), ``python -m benchmarks.tuning.sass_diff
--dump after.json``, then ``python -m benchmarks.tuning.sass_diff --compare before.json
after.json``; prints markdown.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections import Counter
from collections.abc import Callable

import torch

from benchmarks._sm90 import (
    compile_for_sm90,
    cuobjdump,
    nvidia_tools,
    record_launches,
    sass_loops,
)

SCHEMES = {"int4": {"group_size": 128}, "mxfp4": {}, "nvfp4": {}}
SHAPES = ((4096, 4096), (28672, 4096), (4096, 14336))
_OFFSET = re.compile(r"/\*[0-9a-f]{4,}\*/")
_CONSTANT_BANK = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def _cases() -> dict[str, Callable[[], None]]:
    """Each case's calls, by label (each records one or two launches)."""
    from qlens.kernels.experts import ExpertsPlan
    from qlens.kernels.plan import LinearPlan
    from qlens.kernels.sibling_gemv import sibling_gemv
    from qlens.kernels.weights import kernel_weight
    from qlens.quant.quantize import quantize_weight

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    cases: dict[str, Callable[[], None]] = {}
    for scheme, options in SCHEMES.items():
        for n, k in SHAPES:
            for m in (1, 16):

                def linear(n=n, k=k, m=m, scheme=scheme, options=options) -> None:
                    payload = quantize_weight(torch.randn(n, k), scheme, **options)
                    LinearPlan(payload, cpu, route="kernel")(torch.randn(m, k, dtype=bf16))

                cases[f"{scheme} {n} x {k}, {m} row{'s' if m > 1 else ''}"] = linear

        def siblings(scheme=scheme, options=options) -> None:
            views = [
                kernel_weight(quantize_weight(torch.randn(n, 4096), scheme, **options))
                for n in (4096, 1024, 1024)
            ]
            launch = sibling_gemv(views, bf16, False, cpu)
            assert not isinstance(launch, str), launch
            launch(torch.randn(1, 4096, dtype=bf16), None)

        def routed(scheme=scheme, options=options) -> None:
            weights = quantize_weight(torch.randn(8, 1536, 2048), scheme, **options)
            ExpertsPlan(weights, cpu).rows(torch.randn(8, 2048, dtype=bf16), torch.arange(8), None)

        cases[f"{scheme} q/k/v siblings, 1 row"] = siblings
        cases[f"{scheme} 8 routed experts, 1 row each"] = routed
    return cases


def dump() -> dict[str, list[str]]:
    """The SASS listing of every recorded launch, by case and launch."""
    tools = nvidia_tools()
    if tools is None:
        raise SystemExit("Triton's NVIDIA backend tools (ptxas, cuobjdump) are missing")
    recorded = record_launches()
    listings: dict[str, list[str]] = {}
    for label, calls in _cases().items():
        calls()
        for i, (kernel, args, options) in enumerate(recorded):
            sass = cuobjdump(compile_for_sm90(kernel, args, options), tools, "--dump-sass")
            listings[f"{label} #{i + 1} {kernel.__name__}"] = sass.splitlines()
        recorded.clear()
    return listings


def _code(listing: list[str]) -> list[str]:
    """The instructions of a listing, their offsets dropped."""
    return [_OFFSET.sub("", line).strip() for line in listing if ";" in line]


def _loops(listing: list[str]) -> list[Counter]:
    """The opcodes of each loop of a listing (the K loops), counted."""
    return sass_loops("\n".join(listing))


def _sizes(loops: list[Counter]) -> str:
    """Instructions in each loop, as ``a+b``."""
    return "+".join(str(sum(loop.values())) for loop in loops) or "-"


def compare(before: dict[str, list[str]], after: dict[str, list[str]]) -> str:
    """A markdown table: per launch, its instructions and loop sizes before and after, and
    whether the code is the same."""
    rows = [
        "| launch | instructions before | after | loop instructions before | after | loops' "
        "opcodes alike | same code |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in sorted(before.keys() | after.keys()):
        old, new = before.get(label), after.get(label)
        if old is None or new is None:
            rows.append(
                f"| {label} | {len(_code(old or []))} | {len(_code(new or []))} | | | | "
                "one side only |"
            )
            continue
        old_code, new_code = _code(old), _code(new)
        if old_code == new_code:
            verdict = "yes"
        elif [_CONSTANT_BANK.sub("c[]", x) for x in old_code] == [
            _CONSTANT_BANK.sub("c[]", x) for x in new_code
        ]:
            verdict = "yes, but for argument offsets"
        else:
            changed = sum(
                1
                for line in difflib.unified_diff(old_code, new_code, lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))
            )
            verdict = f"no ({changed} lines differ)"
        old_loops, new_loops = _loops(old), _loops(new)
        rows.append(
            f"| {label} | {len(old_code)} | {len(new_code)} | {_sizes(old_loops)} | "
            f"{_sizes(new_loops)} | {'yes' if old_loops == new_loops else 'no'} | {verdict} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--dump", metavar="JSON", help="write this commit's SASS listings here")
    group.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--qlens-from", metavar="DIR", help="import qlens from this checkout")
    args = parser.parse_args()
    if args.qlens_from:
        if "qlens" in sys.modules:
            raise SystemExit("qlens was imported before --qlens-from could apply")
        sys.path.insert(0, args.qlens_from)
    if args.dump:
        listings = dump()
        import qlens

        print(f"qlens from {qlens.__file__}")
        with open(args.dump, "w", encoding="utf-8") as f:
            json.dump(listings, f)
        print(f"{len(listings)} launches written to {args.dump}")
    else:
        with (
            open(args.compare[0], encoding="utf-8") as f,
            open(args.compare[1], encoding="utf-8") as g,
        ):
            print(compare(json.load(f), json.load(g)))


if __name__ == "__main__":
    main()
