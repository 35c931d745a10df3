"""Drift dashboard: how far a quantized model moves from its reference, per layer (residual
cosine, relative error...), per head (attention-pattern change) and overall (logit KL...), read
from a drift result's ``to_dict()`` (``qlens.analysis.DriftReport``)."""

from __future__ import annotations

import html
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets
import torch
from jaxtyping import Float
from torch import Tensor

from qlens.viz import figures, static
from qlens.viz.viewer import Viewer

# Keys that may hold the layer labels, in order of preference ("layer" when given as records).
LABEL_KEYS = ("layers", "layer_labels", "labels", "hook_names", "names", "layer")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_number_list(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(_is_number(v) for v in value)
    )


def _is_matrix(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(_is_number_list(row) and len(row) == len(value[0]) for row in value)
    )


@dataclass
class DriftData:
    """A drift result split by kind: per-layer series, per-layer-and-head matrices, scalars."""

    layer_labels: list[str]
    series: dict[str, list[float]]
    matrices: dict[str, list[list[float]]]
    scalars: dict[str, float]


def _columns(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten one level of nesting; turn a list of per-layer records into columns."""
    columns: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            columns.update(value)
        elif isinstance(value, Sequence) and value and all(isinstance(r, Mapping) for r in value):
            keys = [k for k in value[0] if all(k in r for r in value)]
            columns.update({k: [r[k] for r in value] for k in keys})
        else:
            columns[key] = value
    return columns


def read_drift(drift: Any) -> DriftData:
    """Split a drift result (an object with ``to_dict()`` or a mapping) by kind.

    Per-layer series are lists of numbers, one per layer (``{"resid_cosine": [...]}``), given as
    columns, nested one level, or as records (``{"layers": [{"layer": 0, "cosine": ...}]}``);
    layer labels come from a ``layers``/``labels``-like key, else are the indices.
    """
    data = drift.to_dict() if hasattr(drift, "to_dict") else drift
    if not isinstance(data, Mapping):
        raise TypeError(
            f"expected a drift result with to_dict() or a mapping, got {type(drift).__name__}"
        )
    columns = _columns(data)
    label_key = next(
        (
            k
            for k in LABEL_KEYS
            if isinstance(columns.get(k), Sequence) and not isinstance(columns[k], str)
        ),
        None,
    )
    series = {k: v for k, v in columns.items() if k != label_key and _is_number_list(v)}
    if label_key is not None:
        labels = [str(v) for v in columns[label_key]]
    else:
        lengths = {len(v) for v in series.values()} | {
            len(v) for v in columns.values() if _is_matrix(v)
        }
        labels = [str(i) for i in range(lengths.pop())] if len(lengths) == 1 else []
    data_out = DriftData(
        layer_labels=labels,
        series={k: [float(x) for x in v] for k, v in series.items() if len(v) == len(labels)},
        matrices={
            k: [[float(x) for x in row] for row in v]
            for k, v in columns.items()
            if k != label_key and _is_matrix(v) and len(v) == len(labels)
        },
        scalars={k: float(v) for k, v in columns.items() if _is_number(v)},
    )
    if not data_out.series and not data_out.matrices:
        raise ValueError(
            "the drift result holds no per-layer numeric series matching its layer labels; "
            f"got keys {sorted(columns)}. Expected e.g. {{'resid_cosine': [...per layer]}}"
        )
    return data_out


class DriftDashboard(Viewer):
    """Per-layer drift plots with a ``metric`` selector and a ``log_scale`` toggle.

    Per-layer series show as lines; per-layer-and-head matrices (``pattern_change``) as a
    layer × head heatmap; scalars (``logit_kl``, ``top1_agreement``...) as a summary line.
    """

    def __init__(self, drift: Any, *, metric: str | None = None) -> None:
        self.data = read_drift(drift)
        names = [*self.data.series, *self.data.matrices]
        if metric is not None and metric not in names:
            raise ValueError(f"metric {metric!r} is not in the drift result; choose one of {names}")
        self.metric = widgets.Dropdown(
            options=names, value=metric or names[0], description="metric"
        )
        self.log_scale = widgets.Checkbox(value=False, description="log scale")
        self._finish([self.metric, self.log_scale])

    @property
    def layer_labels(self) -> list[str]:
        return self.data.layer_labels

    @property
    def displayed(self) -> Float[Tensor, "layer ..."]:
        """The selected metric: ``[layer]`` for a series, ``[layer head]`` for a matrix."""
        name = self.metric.value
        values = self.data.series.get(name, self.data.matrices.get(name))
        return torch.tensor(values, dtype=torch.float64)

    def _summary_html(self) -> str:
        if not self.data.scalars:
            return ""
        items = " · ".join(f"{html.escape(k)} = {v:.4g}" for k, v in self.data.scalars.items())
        return f"<div><small>{items}</small></div>"

    def _render_html(self) -> str:
        name, values = self.metric.value, self.displayed
        if values.ndim == 1:
            plot = static.per_layer_metric(self.layer_labels, values, name, self.log_scale.value)
        else:
            heads = [str(h) for h in range(values.shape[1])]
            figure = figures.token_heatmap_figure(
                values, heads, self.layer_labels, f"{name} per layer (rows) and head (columns)"
            )
            plot = static.figure_html(figure, f"{name} per layer and head")
        return plot + self._summary_html()
