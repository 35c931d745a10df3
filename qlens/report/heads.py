"""Report section: induction and previous-token heads of every model version, found on a
repeated random-token sequence."""

from __future__ import annotations

import html
from typing import Any

from jaxtyping import Float
from torch import Tensor

from qlens.analysis import head_scores, repeated_random_tokens
from qlens.report import plots
from qlens.report.build import ReportContext, Section
from qlens.report.page import table

KINDS = ("induction", "previous_token")
SEQ_LEN = 24  # random tokens, then the same tokens again
SEED = 0
THRESHOLD = 0.4  # a head "is" of a kind when its mean attention on the kind's targets reaches this
TOP = 5  # heads listed per kind and version


def found_heads(scores: Float[Tensor, "layer head"], threshold: float) -> list[dict[str, Any]]:
    """Heads scoring at least ``threshold``, best first."""
    layers, heads = (scores >= threshold).nonzero(as_tuple=True)
    found = [
        {"layer": int(layer), "head": int(head), "score": float(scores[layer, head])}
        for layer, head in zip(layers, heads, strict=True)
    ]
    return sorted(found, key=lambda h: -h["score"])


def top_heads(scores: Float[Tensor, "layer head"], k: int) -> list[dict[str, Any]]:
    """The ``k`` best-scoring heads, best first."""
    values, flat = scores.flatten().topk(min(k, scores.numel()))
    n_heads = scores.shape[1]
    return [
        {"layer": int(i) // n_heads, "head": int(i) % n_heads, "score": float(v)}
        for v, i in zip(values, flat, strict=True)
    ]


def section(context: ReportContext) -> Section:
    bridge = context.bridge
    special = list(getattr(bridge.tokenizer, "all_special_ids", []) or [])
    low = max(special) + 1 if special and max(special) + 1 < bridge.cfg.d_vocab // 2 else 0
    tokens = repeated_random_tokens(bridge.cfg.d_vocab, SEQ_LEN, seed=SEED, low=low)
    scores = {
        variant.label: {
            kind: labeled.values.detach().float().cpu()
            for kind, labeled in head_scores(variant.bridge, tokens, KINDS).items()
        }
        for variant in context.variants
    }
    data: dict[str, Any] = {
        "sequence": {"seq_len": SEQ_LEN, "repeats": 2, "seed": SEED, "lowest_token_id": low},
        "threshold": THRESHOLD,
        "variants": {
            label: {
                kind: {
                    "found": found_heads(result[kind], THRESHOLD),
                    "top": top_heads(result[kind], TOP),
                    "scores": result[kind].tolist(),
                }
                for kind in KINDS
            }
            for label, result in scores.items()
        },
    }
    labels = list(scores)
    header = ["kind", *labels]
    rows = [
        [
            kind,
            *(_heads_cell(data["variants"][label][kind]) for label in labels),
        ]
        for kind in KINDS
    ]
    lines = [
        f"on {SEQ_LEN} random tokens repeated once (seed {SEED}); heads scoring >= {THRESHOLD}, "
        f"best {TOP} shown as layer.head=score"
    ]
    for kind, *cells in rows:
        lines.append(f"{kind}:")
        lines += [f"  {label:<14} {cell}" for label, cell in zip(labels, cells, strict=True)]
    figure = plots.head_scores_png(
        {kind: {label: result[kind].numpy() for label, result in scores.items()} for kind in KINDS}
    )
    return Section(
        "heads",
        "Induction and previous-token heads",
        data,
        "\n".join(lines),
        html=f"<p>{html.escape(lines[0])}</p>" + table(header, rows),
        figures={"head_scores": figure},
    )


def _heads_cell(entry: dict[str, Any]) -> str:
    found = entry["found"]
    if not found:
        best = entry["top"][0]
        return f"none (best {best['layer']}.{best['head']}={best['score']:.2f})"
    shown = ", ".join(f"{h['layer']}.{h['head']}={h['score']:.2f}" for h in found[:TOP])
    more = f" (+{len(found) - TOP} more)" if len(found) > TOP else ""
    return f"{len(found)} heads: {shown}{more}"
