"""Eager decode of one random-weight Llama under several variants of qlens, each paired with
bf16: the shared loop of the whole-model tuning runs (``one_row_split_e2e``,
``sibling_launch_e2e``).

Per shape, the bf16 model is built once; per scheme and variant, it is quantized inside the
variant's context, and its ``generate`` is timed in back-to-back pairs with bf16's
(``paired_time_ratio``), so a drifting host slows both sides of a pair alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

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

Variant = tuple[
    str, Callable[[], contextlib.AbstractContextManager[object]], Callable[[nn.Module], object]
]  # noqa: E501
_TABLE_HEAD = [
    "| shape | scheme | variant | decode vs bf16 (paired) | tok/s |",
    "|---|---|---|---|---|",
]


def no_change(model: nn.Module) -> None:
    """A variant's model as ``qlens.quantize`` returns it."""


def paired_decode_rows(
    sizes: Sequence[str], schemes: Sequence[str], variants: Sequence[Variant], repeats: int
) -> list[str]:
    """Markdown rows: per shape, scheme and variant ``(name, context, adjust)``, the paired
    decode ratio against bf16 and one timed run's tokens per second. The model is quantized
    inside ``context()`` and then given to ``adjust``."""
    dev = torch.device("cuda")
    rows: list[str] = []
    for size in sizes:
        shape = shapes(tiny=False, prefill_tokens=None)[size]
        base = build_model(shape, dev)
        gen = torch.Generator().manual_seed(0)
        vocab = shape.config["vocab_size"]
        work = Workload(
            tokens=torch.empty(0),
            prompt=torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(dev),
            decode_tokens=64,
            repeats=repeats,
            compile_backend="inductor",
        )
        base_run = decode_call(hf_generate(base), work, work.decode_tokens)
        with torch.no_grad():
            for _ in range(2):
                base_run()
            for scheme in schemes:
                for name, context, adjust in variants:
                    with context():
                        model = qlens.quantize(base, scheme)
                        adjust(model)
                        run = decode_call(hf_generate(model), work, work.decode_tokens)
                        ratio = paired_time_ratio(base_run, run, work.repeats)
                        tok_s = work.decode_tokens / _seconds(run)
                    rows.append(
                        f"| {shape.label} | {scheme} | {name} | {ratio:.3f}x | {tok_s:.1f} |"
                    )
                    print(rows[-1], flush=True)
                    del model, run
                    free_memory()
        del base, base_run
        free_memory()
    return rows


def publish_paired_decode(title: str, rows: list[str], filename: str) -> None:
    """Print ``rows`` under ``title`` and the timing they were measured with; with ``$OUT``
    set, also write them to ``$OUT/filename``."""
    timing = (
        "wall clock of 64 greedy tokens after a 32-token prompt, batch 1; ratio: median of "
        "back-to-back bf16/quantized pairs"
    )
    publish(header(title, timing) + "\n".join(_TABLE_HEAD + rows), filename)


def _seconds(run: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
