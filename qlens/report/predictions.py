"""Report section: the most likely next tokens after the prompt, for every model version."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.bridge import Bridge
from qlens.report import plots
from qlens.report.build import ReportContext, Section
from qlens.report.page import table


def top_predictions(bridge: Bridge, last: Float[Tensor, " vocab"], k: int) -> list[dict]:
    """The ``k`` most likely next tokens of one position's logits, with probability and logit."""
    last = last.float()
    probabilities = torch.softmax(last, dim=-1)
    top = torch.topk(probabilities, k=min(k, probabilities.numel()))
    return [
        {
            "rank": rank,
            "token": bridge.to_string(token_id.reshape(1)),
            "token_id": int(token_id),
            "probability": float(probability),
            "logit": float(last[token_id]),
        }
        for rank, (probability, token_id) in enumerate(
            zip(top.values, top.indices, strict=True), start=1
        )
    ]


def section(context: ReportContext) -> Section:
    data = {
        variant.label: top_predictions(variant.bridge, variant.logits[0, -1], context.top_k)
        for variant in context.variants
    }
    labels = list(data)
    cells = {
        label: [f"{r['token']!r} {r['probability']:.3f}" for r in rows]
        for label, rows in data.items()
    }
    width = max(len(c) for column in cells.values() for c in column) + 2
    widths = [max(width, len(label) + 2) for label in labels]
    lines = ["rank " + "".join(f"{label:<{w}}" for label, w in zip(labels, widths, strict=True))]
    for index in range(len(cells[labels[0]])):
        lines.append(
            f"{index + 1:>3}. "
            + "".join(
                f"{cells[label][index]:<{w}}" for label, w in zip(labels, widths, strict=True)
            )
        )
    page = table(
        ["rank", *labels],
        [
            [index + 1, *(cells[label][index] for label in labels)]
            for index in range(len(cells[labels[0]]))
        ],
    )
    figure = plots.top_predictions_png(
        {label: [(r["token"], r["probability"]) for r in rows] for label, rows in data.items()}
    )
    return Section(
        "top_predictions",
        "Top next-token predictions (token, probability)",
        data,
        "\n".join(line.rstrip() for line in lines),
        html=page,
        figures={"top_predictions": figure},
    )
