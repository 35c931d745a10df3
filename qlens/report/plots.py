"""The report's figures, as PNG bytes (matplotlib Agg figures, no pyplot state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from qlens.viz.figures import figure_png
from qlens.viz.labels import token_label


def weight_bytes_png(
    labels: Sequence[str], megabytes: Sequence[float], notes: Sequence[str]
) -> bytes:
    """One bar per model version: weight megabytes, annotated (e.g. with the compression ratio)."""
    figure = Figure(figsize=(max(4.0, 1.4 * len(labels) + 1.5), 3.2))
    ax = figure.subplots()
    bars = ax.bar(range(len(labels)), megabytes, color="tab:blue")
    for bar, note in zip(bars, notes, strict=True):
        ax.annotate(
            note,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(labels)), list(labels), fontsize=9)
    ax.set_ylabel("weight storage (MB)")
    ax.set_ylim(0, max(megabytes, default=1.0) * 1.2 or 1.0)
    ax.set_title("weights per model version", fontsize=10)
    return figure_png(figure)


def top_predictions_png(panels: Mapping[str, Sequence[tuple[str, float]]]) -> bytes:
    """One horizontal bar chart of (token, probability) per model version, side by side."""
    n = max(len(panels), 1)
    rows = max((len(cells) for cells in panels.values()), default=1)
    figure = Figure(figsize=(3.2 * n, 0.3 * rows + 1.4))
    axes = figure.subplots(1, n, squeeze=False)[0]
    for ax, (label, cells) in zip(axes, panels.items(), strict=False):
        tokens = [token_label(t) for t, _ in cells]
        ax.barh(range(len(cells)), [p for _, p in cells], color="tab:green")
        ax.set_yticks(range(len(cells)), tokens, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("probability", fontsize=8)
        ax.set_title(label, fontsize=10)
    figure.suptitle("top next-token predictions", fontsize=10)
    return figure_png(figure)


def per_layer_lines_png(series: Mapping[str, Mapping[str, Sequence[float]]]) -> bytes:
    """One panel per metric (``{metric: {version: per-layer values}}``), one line per version."""
    n = max(len(series), 1)
    figure = Figure(figsize=(4.6 * n, 3.2))
    axes = figure.subplots(1, n, squeeze=False)[0]
    for ax, (metric, lines) in zip(axes, series.items(), strict=False):
        for label, values in lines.items():
            ax.plot(range(len(values)), values, marker="o", markersize=3, label=label)
        ax.set_xlabel("layer")
        ax.set_title(metric, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return figure_png(figure)


def head_scores_png(grid: Mapping[str, Mapping[str, np.ndarray]]) -> bytes:
    """Layer x head heatmaps: one row per head kind, one column per model version
    (``{kind: {version: scores [layer head]}}``), all on the same 0..1 colour scale."""
    kinds = list(grid)
    versions = list(dict.fromkeys(v for panels in grid.values() for v in panels))
    first = next(iter(grid[kinds[0]].values())) if kinds and grid[kinds[0]] else np.zeros((1, 1))
    n_layers, n_heads = first.shape
    width = max(3.0, 0.25 * n_heads + 1.8)
    height = max(2.8, 0.14 * n_layers + 1.4)
    # A constrained layout keeps titles, tick labels and the colour bar from overlapping; only
    # the outer axes carry axis labels.
    figure = Figure(
        figsize=(width * max(len(versions), 1), height * max(len(kinds), 1)), layout="constrained"
    )
    axes = figure.subplots(max(len(kinds), 1), max(len(versions), 1), squeeze=False)
    image = None
    for row, kind in enumerate(kinds):
        for col, version in enumerate(versions):
            ax = axes[row][col]
            image = ax.imshow(
                grid[kind][version], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto"
            )
            ax.set_title(f"{kind}: {version}", fontsize=9)
            ax.set_xticks(range(0, n_heads, max(1, -(-n_heads // 8))))
            ax.set_yticks(range(0, n_layers, max(1, -(-n_layers // 10))))
            ax.tick_params(labelsize=7)
            if row == len(kinds) - 1:
                ax.set_xlabel("head", fontsize=8)
            if col == 0:
                ax.set_ylabel("layer", fontsize=8)
    if image is not None:
        figure.colorbar(image, ax=axes.ravel().tolist(), label="score")
    return figure_png(figure)
