"""Eager decode of whole block-FP8 models with the dispatcher's one-row K splits and without.

``benchmarks.tuning.narrow_rows`` times single layers; this is what a user's ``generate``
pays. The launch census (``benchmarks/results/launch_census_cpu.md``) counts five split
reductions a layer for fp8-block at the 1B shape and two at 8B: each is one more launch a
token. Here the same random-weight Llama is quantized twice, once under the launch table and
once with every one-row GEMV unsplit, and each is decoded eagerly against bf16 in
back-to-back pairs (``paired_time_ratio``), so a drifting host slows both sides alike.

Run on a CUDA GPU: ``python -m benchmarks.tuning.one_row_split_e2e [--sizes 1b,8b]``; prints
markdown and, when ``$OUT`` is set, writes it to ``$OUT/one_row_split_e2e_h200.md``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

import qlens
from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import header, publish
from benchmarks.e2e_model import (
    PROMPT_TOKENS,
    Workload,
    decode_call,
    free_memory,
    hf_generate,
    paired_time_ratio,
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
    dev = torch.device("cuda")
    rows = [
        "| shape | scheme | launch table | decode vs bf16 (paired) | tok/s |",
        "|---|---|---|---|---|",
    ]
    for size in args.sizes.split(","):
        shape = shapes(tiny=False, prefill_tokens=None)[size]
        base = build_model(shape, dev)
        gen = torch.Generator().manual_seed(0)
        vocab = shape.config["vocab_size"]
        work = Workload(
            tokens=torch.empty(0),
            prompt=torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(dev),
            decode_tokens=64,
            repeats=args.repeats,
            compile_backend="inductor",
        )
        base_run = decode_call(hf_generate(base), work, work.decode_tokens)
        with torch.no_grad():
            for _ in range(2):
                base_run()
            for variant, context in (
                ("dispatcher", contextlib.nullcontext()),
                ("one-row unsplit", one_row_unsplit()),
                ("dispatcher (again)", contextlib.nullcontext()),
            ):
                with context:
                    model = qlens.quantize(base, args.scheme)
                    run = decode_call(hf_generate(model), work, work.decode_tokens)
                    ratio = paired_time_ratio(base_run, run, work.repeats)
                    torch.cuda.synchronize()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    run()
                    end.record()
                    end.synchronize()
                    tok_s = work.decode_tokens / (start.elapsed_time(end) / 1e3)
                rows.append(
                    f"| {shape.label} | {args.scheme} | {variant} | {ratio:.3f}x | {tok_s:.1f} |"
                )
                print(rows[-1], flush=True)
                del model, run
                free_memory()
        del base, base_run
        free_memory()
    publish(
        header(
            "Eager decode with and without one-row K splits",
            "wall clock of 64 greedy tokens after a 32-token prompt, batch 1; ratio: median of "
            "back-to-back bf16/quantized pairs",
        )
        + "\n".join(rows),
        "one_row_split_e2e_h200.md",
    )


if __name__ == "__main__":
    main()
