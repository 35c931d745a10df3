"""Static HTML renderings (an embedded PNG, base64) for places without a widget frontend.

Nothing here needs the network: the images are inline ``data:`` URIs and there is no JavaScript.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence

from jaxtyping import Float
from matplotlib.figure import Figure
from torch import Tensor

from qlens.viz import figures
from qlens.viz.labels import token_html


def png_img_tag(png: bytes, alt: str) -> str:
    """An ``<img>`` tag holding ``png`` inline as base64."""
    encoded = base64.b64encode(png).decode("ascii")
    return (
        f'<img src="data:image/png;base64,{encoded}" alt="{html.escape(alt)}" '
        'style="max-width:100%;height:auto"/>'
    )


def figure_html(figure: Figure, alt: str, caption: str = "") -> str:
    """A figure as an HTML block: the inline PNG plus an optional caption."""
    note = f"<div><small>{html.escape(caption)}</small></div>" if caption else ""
    return f"<div>{png_img_tag(figures.figure_png(figure), alt)}{note}</div>"


def attention_pattern(
    panels: Mapping[str, Float[Tensor, "q k"]], tokens: Sequence[str], title: str
) -> str:
    """Attention pattern heatmaps, one per panel (e.g. reference, quantized, difference)."""
    return figure_html(figures.pattern_figure(panels, tokens, title), f"attention pattern: {title}")


def activation_heatmap(
    values: Float[Tensor, "row pos"],
    tokens: Sequence[str],
    row_labels: Sequence[str],
    title: str,
) -> str:
    """Per-token activation values, one row per label."""
    return figure_html(
        figures.token_heatmap_figure(values, tokens, row_labels, title), f"activations: {title}"
    )


def top_tokens_table(rows: Sequence[tuple[str, Sequence[tuple[str, float]]]], title: str) -> str:
    """An HTML table: one row per label with its ranked ``(token, probability)`` cells."""
    width = max((len(cells) for _, cells in rows), default=0)
    head = "".join(f"<th>#{rank + 1}</th>" for rank in range(width))
    body = "".join(
        f"<tr><th>{html.escape(label)}</th>"
        + "".join(f"<td><code>{token_html(t)}</code> {p:.2f}</td>" for t, p in cells)
        + "</tr>"
        for label, cells in rows
    )
    return (
        "<div style='max-width:100%;overflow-x:auto'>"
        f"<table><caption>{html.escape(title)}</caption><tr><th>layer</th>{head}</tr>{body}"
        "</table></div>"
    )


def logit_lens(
    probs: Float[Tensor, "layer pos"],
    top_tokens: Sequence[Sequence[str]],
    layer_labels: Sequence[str],
    tokens: Sequence[str],
    table_rows: Sequence[tuple[str, Sequence[tuple[str, float]]]],
    title: str,
    selected: int | None = None,
) -> str:
    """The logit-lens grid (top token per layer and position, ``selected`` outlined) and a
    top-k table for one position."""
    grid = figures.top_token_grid_figure(probs, top_tokens, layer_labels, tokens, title, selected)
    return figure_html(grid, f"logit lens: {title}") + top_tokens_table(table_rows, title)


def per_layer_metric(
    labels: Sequence[str], values: Float[Tensor, " layer"], metric: str, log_scale: bool = False
) -> str:
    """A per-layer metric (e.g. cosine similarity or KL of a quantized model) as a line plot."""
    figure = figures.per_layer_figure(labels, values, metric, log_scale)
    return figure_html(figure, f"{metric} per layer")
