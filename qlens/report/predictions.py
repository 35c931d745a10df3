"""Report section: the most likely next tokens after the prompt."""

from __future__ import annotations

import torch

from qlens.report.build import ReportContext, Section


def section(context: ReportContext) -> Section:
    last = context.logits[0, -1].float()
    probabilities = torch.softmax(last, dim=-1)
    top = torch.topk(probabilities, k=min(context.top_k, probabilities.numel()))
    rows = [
        {
            "rank": rank,
            "token": context.bridge.to_string(token_id.reshape(1)),
            "token_id": int(token_id),
            "probability": float(probability),
            "logit": float(last[token_id]),
        }
        for rank, (probability, token_id) in enumerate(
            zip(top.values, top.indices, strict=True), start=1
        )
    ]
    text = "\n".join(
        f"{row['rank']:>3}. {row['token']!r:<20} p={row['probability']:.4f}  logit={row['logit']:.3f}"
        for row in rows
    )
    return Section("top_predictions", "Top next-token predictions", rows, text)
