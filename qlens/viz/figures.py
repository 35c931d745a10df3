"""Matplotlib figures for the viewers and their static fallbacks (no pyplot global state)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from jaxtyping import Float
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

from qlens.viz.labels import token_label

_DPI = 80
# Figures stay within a notebook's output width (about 13 inches at 80 dpi is 1040 px); the
# static HTML also scales images down to the width it has.
MAX_WIDTH_INCHES = 12.5
# The static logit-lens grid shows at most this many positions, centred on the selected one.
GRID_WINDOW = 24


def figure_png(figure: Figure) -> bytes:
    """Encode a figure as PNG bytes (Agg backend, no display needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return buffer.getvalue()


def _numpy(values: Tensor) -> np.ndarray:
    return values.detach().to("cpu", torch.float32).numpy()


def text_colour(rgba: Sequence[float] | np.ndarray) -> str:
    """Dark text on light cells, white on dark ones (WCAG relative luminance of the cell)."""
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3])
    return "#111111" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.18 else "white"


def value_scale(data: np.ndarray, log: bool = False) -> dict:
    """``imshow`` colour arguments that fit the values: a log norm (positive values), a
    sequential map from 0 (no negative value) or a diverging map centred on 0 (signed)."""
    finite = data[np.isfinite(data)]
    if log and finite.size and (finite > 0).all():
        return {"cmap": "Blues", "norm": LogNorm(vmin=finite.min(), vmax=finite.max())}
    if not finite.size or finite.min() >= 0:
        return {"cmap": "Blues", "vmin": 0.0, "vmax": float(finite.max()) if finite.size else 1.0}
    bound = float(np.abs(finite).max()) or 1.0
    return {"cmap": "RdBu_r", "vmin": -bound, "vmax": bound}


def _annotate(ax, image, data: np.ndarray, text: Sequence[Sequence[str]], fontsize: int) -> None:
    """Write ``text`` in every cell, its colour chosen by the cell's luminance."""
    colours = image.cmap(image.norm(data))
    for (row, col), _ in np.ndenumerate(data):
        ax.text(
            col,
            row,
            text[row][col],
            ha="center",
            va="center",
            fontsize=fontsize,
            color=text_colour(colours[row, col]),
        )


def _token_ticks(axis_set, tokens: Sequence[str], axis: str) -> None:
    labels = [token_label(t) for t in tokens]
    if axis == "x":
        axis_set.set_xticks(range(len(labels)), labels, rotation=90, fontsize=8)
    else:
        axis_set.set_yticks(range(len(labels)), labels, fontsize=8)


def pattern_figure(
    panels: Mapping[str, Float[Tensor, "q k"]], tokens: Sequence[str], title: str
) -> Figure:
    """One heatmap per panel (query rows, key columns); a panel named ``difference`` is drawn
    with a symmetric diverging colour map. The panels share the output width."""
    n = len(panels)
    size = min(max(3.0, 0.25 * len(tokens) + 1.5), 8.0, MAX_WIDTH_INCHES / n)
    figure = Figure(figsize=(size * n, size + 0.6), layout="constrained")
    axes = figure.subplots(1, n, squeeze=False)[0]
    ticks = len(tokens) <= 48
    for ax, (label, values) in zip(axes, panels.items(), strict=True):
        data = _numpy(values)
        if label == "difference":
            bound = float(np.abs(data).max()) or 1.0
            image = ax.imshow(data, cmap="RdBu_r", vmin=-bound, vmax=bound)
        else:
            image = ax.imshow(data, cmap="Blues", vmin=0.0, vmax=1.0)
        ax.set_title(label, fontsize=10)
        if ticks:
            _token_ticks(ax, tokens, "x")
            _token_ticks(ax, tokens, "y")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    figure.suptitle(title)
    return figure


def token_heatmap_figure(
    values: Float[Tensor, "row pos"],
    tokens: Sequence[str],
    row_labels: Sequence[str],
    title: str,
) -> Figure:
    """Rows of per-token values, tokens along x: a sequential colour map for non-negative
    values, diverging centred on zero for signed ones. Each row is a strip of square cells."""
    data = _numpy(values)
    width = min(max(4.0, 0.45 * len(tokens) + 2), MAX_WIDTH_INCHES)
    cell = (width - 2) / max(1, len(tokens))
    figure = Figure(figsize=(width, cell * len(row_labels) + 2.2), layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(data, aspect="auto", **value_scale(data))
    _token_ticks(ax, tokens, "x")
    ax.set_yticks(range(len(row_labels)), list(row_labels), fontsize=8)
    if data.size <= 400:
        text = [[f"{v:.2g}" for v in row] for row in data]
        _annotate(ax, image, data, text, 7)
    figure.colorbar(image, ax=ax, orientation="horizontal", fraction=0.08, aspect=40)
    ax.set_title(title, fontsize=10)
    return figure


def layer_head_figure(
    values: Float[Tensor, "layer head"], layer_labels: Sequence[str], metric: str, log: bool
) -> Figure:
    """A per-layer-and-head metric (rows layers, columns heads) with labelled axes."""
    data = _numpy(values)
    n_layers, n_heads = data.shape
    figure = Figure(
        figsize=(min(0.5 * n_heads + 2.5, MAX_WIDTH_INCHES), 0.3 * n_layers + 1.6),
        layout="constrained",
    )
    ax = figure.subplots()
    image = ax.imshow(data, aspect="auto", **value_scale(data, log))
    ax.set_xticks(range(n_heads), [str(h) for h in range(n_heads)], fontsize=8)
    ax.set_yticks(range(n_layers), list(layer_labels), fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if data.size <= 400:
        _annotate(ax, image, data, [[f"{v:.2g}" for v in row] for row in data], 7)
    figure.colorbar(image, ax=ax, label=metric + (" (log)" if log else ""))
    ax.set_title(f"{metric} per layer and head", fontsize=10)
    return figure


def grid_window(n_pos: int, selected: int, size: int = GRID_WINDOW) -> range:
    """The positions a static grid shows: all of them, or ``size`` around ``selected``."""
    start = min(max(0, selected - size // 2), max(0, n_pos - size))
    return range(start, min(n_pos, start + size))


def top_token_grid_figure(
    probs: Float[Tensor, "layer pos"],
    top_tokens: Sequence[Sequence[str]],
    layer_labels: Sequence[str],
    tokens: Sequence[str],
    title: str,
    selected: int | None = None,
) -> Figure:
    """Logit-lens grid: the top token of every (layer, position) cell, coloured by its
    probability. Long prompts show the :func:`grid_window` around ``selected``, which is
    outlined."""
    window = grid_window(len(tokens), len(tokens) - 1 if selected is None else selected)
    data = _numpy(probs)[:, window.start : window.stop]
    cells = [list(row[window.start : window.stop]) for row in top_tokens]
    width = min(max(4.0, 0.55 * len(window) + 2.5), MAX_WIDTH_INCHES)
    figure = Figure(figsize=(width, 0.3 * len(layer_labels) + 2.2), layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(data, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    text = [[token_label(token, 7) for token in row] for row in cells]
    _annotate(ax, image, data, text, 7)
    _token_ticks(ax, [tokens[p] for p in window], "x")
    ax.set_xticks(range(len(window)), [f"{p}: {token_label(tokens[p], 10)}" for p in window])
    ax.set_yticks(range(len(layer_labels)), list(layer_labels), fontsize=7)
    if selected is not None and selected in window:
        column = selected - window.start
        ax.add_patch(
            Rectangle((column - 0.5, -0.5), 1, len(layer_labels), fill=False, lw=2, ec="#d6604d")
        )
        ax.get_xticklabels()[column].set_color("#d6604d")
    shown = (
        "" if len(window) == len(tokens) else f" {window.start}-{window.stop - 1} of {len(tokens)}"
    )
    ax.set_xlabel(f"position (input token){shown}")
    figure.colorbar(image, ax=ax, label="top-1 probability")
    ax.set_title(title, fontsize=10)
    return figure


def per_layer_figure(
    labels: Sequence[str], values: Float[Tensor, " layer"], metric: str, log_scale: bool
) -> Figure:
    """One metric per layer as a line with markers."""
    figure = Figure(figsize=(min(max(4.0, 0.22 * len(labels) + 2), MAX_WIDTH_INCHES), 3.0))
    ax = figure.subplots()
    ax.plot(range(len(labels)), _numpy(values), marker="o", markersize=3)
    step = max(1, len(labels) // 20)
    ax.set_xticks(range(0, len(labels), step), list(labels)[::step], rotation=90, fontsize=8)
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel(metric + (" (log)" if log_scale else ""))
    ax.set_xlabel("layer")
    ax.grid(alpha=0.3)
    ax.set_title(f"{metric} per layer", fontsize=10)
    return figure
