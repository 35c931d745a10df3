"""Matplotlib figures for the viewers and their static fallbacks (no pyplot global state)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from jaxtyping import Float
from matplotlib.figure import Figure
from torch import Tensor

from qlens.viz.labels import token_label

_DPI = 80


def figure_png(figure: Figure) -> bytes:
    """Encode a figure as PNG bytes (Agg backend, no display needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return buffer.getvalue()


def _numpy(values: Tensor) -> np.ndarray:
    return values.detach().to("cpu", torch.float32).numpy()


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
    with a symmetric diverging colour map."""
    n = len(panels)
    size = min(max(3.0, 0.25 * len(tokens) + 1.5), 8.0)
    figure = Figure(figsize=(size * n, size))
    axes = figure.subplots(1, n, squeeze=False)[0]
    for ax, (label, values) in zip(axes, panels.items(), strict=True):
        data = _numpy(values)
        if label == "difference":
            bound = float(np.abs(data).max()) or 1.0
            image = ax.imshow(data, cmap="RdBu_r", vmin=-bound, vmax=bound)
        else:
            image = ax.imshow(data, cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(label, fontsize=10)
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
    """Rows of per-token values (diverging colours centred on zero), tokens along x."""
    data = _numpy(values)
    figure = Figure(figsize=(max(4.0, 0.45 * len(tokens) + 2), 0.45 * len(row_labels) + 1.8))
    ax = figure.subplots()
    bound = float(np.abs(data).max()) or 1.0
    image = ax.imshow(data, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    _token_ticks(ax, tokens, "x")
    ax.set_yticks(range(len(row_labels)), list(row_labels), fontsize=8)
    if data.shape[0] * data.shape[1] <= 400:
        for (row, col), value in np.ndenumerate(data):
            ax.text(col, row, f"{value:.2g}", ha="center", va="center", fontsize=7)
    figure.colorbar(image, ax=ax)
    ax.set_title(title, fontsize=10)
    return figure


def top_token_grid_figure(
    probs: Float[Tensor, "layer pos"],
    top_tokens: Sequence[Sequence[str]],
    layer_labels: Sequence[str],
    tokens: Sequence[str],
    title: str,
) -> Figure:
    """Logit-lens grid: the top token of every (layer, position) cell, coloured by its probability."""
    data = _numpy(probs)
    figure = Figure(figsize=(max(4.0, 1.0 * len(tokens) + 2), 0.3 * len(layer_labels) + 1.8))
    ax = figure.subplots()
    image = ax.imshow(data, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for row, cells in enumerate(top_tokens):
        for col, token in enumerate(cells):
            colour = "white" if data[row, col] > 0.6 else "black"
            ax.text(
                col, row, token_label(token, 8), ha="center", va="center", fontsize=7, color=colour
            )
    _token_ticks(ax, tokens, "x")
    ax.set_yticks(range(len(layer_labels)), list(layer_labels), fontsize=7)
    ax.set_xlabel("position (input token)")
    figure.colorbar(image, ax=ax, label="top-1 probability")
    ax.set_title(title, fontsize=10)
    return figure


def per_layer_figure(
    labels: Sequence[str], values: Float[Tensor, " layer"], metric: str, log_scale: bool
) -> Figure:
    """One metric per layer as a line with markers."""
    figure = Figure(figsize=(max(4.0, 0.22 * len(labels) + 2), 3.0))
    ax = figure.subplots()
    ax.plot(range(len(labels)), _numpy(values), marker="o", markersize=3)
    step = max(1, len(labels) // 20)
    ax.set_xticks(range(0, len(labels), step), list(labels)[::step], rotation=90, fontsize=8)
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel(metric)
    ax.set_xlabel("layer")
    ax.grid(alpha=0.3)
    ax.set_title(f"{metric} per layer", fontsize=10)
    return figure
