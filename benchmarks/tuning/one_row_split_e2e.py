"""Eager decode of whole block-FP8 models with the dispatcher's one-row K splits and without.

``benchmarks.tuning.narrow_rows`` times single layers; this is what a user's ``generate``
pays. The launch census (``benchmarks/results/launch_census_cpu.md``) counted five split
reductions a layer for fp8-block at the 1B shape and two at 8B: each is one more launch a
token. Here the same random-weight Llama is quantized twice, once under the launch table and
once with every one-row GEMV unsplit, and each is decoded eagerly against bf16 in
back-to-back pairs (``benchmarks.tuning._paired_decode``).

Run on a CUDA GPU: ``python -m benchmarks.tuning.one_row_split_e2e [--sizes 1b,8b]``; prints
markdown and, when ``$OUT`` is set, writes it to ``$OUT/one_row_split_e2e_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from benchmarks.tuning._paired_decode import (
    Variant,
    no_change,
    paired_decode_rows,
    publish_paired_decode,
)
from qlens.kernels import configs


@contextlib.contextmanager
def one_row_unsplit() -> Iterator[None]:
    """The launch table with every one-row GEMV left unsplit (plans built inside keep it)."""
    table_split = configs.split_k_for

    def unsplit(m: int, n: int, k: int, cfg: configs.LinearConfig, sms: int) -> int:
        return 1 if m == 1 and cfg.path == "gemv" else table_split(m, n, k, cfg, sms)

    configs.split_k_for = unsplit
    configs._table_config.cache_clear()
    try:
        yield
    finally:
        configs.split_k_for = table_split
        configs._table_config.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1b,8b")
    parser.add_argument("--scheme", default="fp8-block")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    variants: list[Variant] = [
        ("launch table", contextlib.nullcontext, no_change),
        ("one-row unsplit", one_row_unsplit, no_change),
        ("launch table (again)", contextlib.nullcontext, no_change),
    ]
    rows = paired_decode_rows(args.sizes.split(","), [args.scheme], variants, args.repeats)
    publish_paired_decode(
        "Eager decode with and without one-row K splits",
        rows,
        "one_row_split_e2e_h200.md",
    )


if __name__ == "__main__":
    main()
