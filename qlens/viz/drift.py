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
import traitlets
from jaxtyping import Float
from torch import Tensor

from qlens.viz import figures, static
from qlens.viz.browser import BrowserView, module_source
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


class DriftView(BrowserView):
    """Every metric of a drift result (a few numbers per layer, so plain JSON keeps their full
    precision), the selected ``metric`` (index into ``metrics``) and ``log_scale``."""

    _esm = traitlets.Unicode(module_source("drift")).tag(sync=True)
    layer_labels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    metrics = traitlets.List(traitlets.Unicode()).tag(sync=True)
    series = traitlets.Dict().tag(sync=True)
    matrices = traitlets.Dict().tag(sync=True)
    scalars = traitlets.Dict().tag(sync=True)
    log_allowed = traitlets.List(traitlets.Bool()).tag(sync=True)
    metric = traitlets.Int(0).tag(sync=True)
    log_scale = traitlets.Bool(False).tag(sync=True)


def log_scale_fits(values: Sequence[Any]) -> bool:
    """A log scale shows a metric only when every value is positive (cosines near 1, errors
    and KLs above 0); a metric with zeros or negatives keeps the linear scale."""
    flat = [v for row in values for v in (row if isinstance(row, list) else [row])]
    return all(v > 0 for v in flat)


class DriftDashboard(Viewer):
    """Per-layer drift plots with a ``metric`` selector and a ``log_scale`` toggle.

    Per-layer series show as lines; per-layer-and-head matrices (``pattern_change``) as a
    layer × head heatmap (a sequential colour scale for non-negative values, diverging around 0
    otherwise); scalars (``logit_kl``, ``top1_agreement``...) as a summary line. Both selectors
    redraw in the browser; ``log_scale`` is disabled for a metric with values <= 0. ``metric``
    and ``log_scale`` are a ``Dropdown`` and a ``Checkbox`` holding the selection in the kernel.
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
        allowed = [log_scale_fits(self._values(name)) for name in names]
        self._log_allowed = dict(zip(names, allowed, strict=True))
        self.metric.observe(self._on_metric_change, names="value")
        self._on_metric_change({})
        view = DriftView(
            layer_labels=self.data.layer_labels,
            metrics=names,
            series=self.data.series,
            matrices=self.data.matrices,
            scalars=self.data.scalars,
            log_allowed=allowed,
        )
        self._finish(
            view, [(self.metric, "index", "metric"), (self.log_scale, "value", "log_scale")]
        )

    def _values(self, name: str) -> list[Any]:
        return list(self.data.series.get(name, self.data.matrices.get(name, [])))

    def _on_metric_change(self, _change: dict) -> None:
        self.log_scale.disabled = not self._log_allowed[self.metric.value]

    @property
    def layer_labels(self) -> list[str]:
        return self.data.layer_labels

    @property
    def displayed(self) -> Float[Tensor, "layer ..."]:
        """The selected metric: ``[layer]`` for a series, ``[layer head]`` for a matrix."""
        return torch.tensor(self._values(self.metric.value), dtype=torch.float64)

    @property
    def log_scale_shown(self) -> bool:
        """Whether the plot currently uses a log scale (the toggle is on and the metric fits)."""
        return self.log_scale.value and self._log_allowed[self.metric.value]

    def _summary_html(self) -> str:
        if not self.data.scalars:
            return ""
        items = " · ".join(f"{html.escape(k)} = {v:.4g}" for k, v in self.data.scalars.items())
        return f"<div><small>{items}</small></div>"

    def _render_html(self) -> str:
        name, values = self.metric.value, self.displayed
        if values.ndim == 1:
            plot = static.per_layer_metric(self.layer_labels, values, name, self.log_scale_shown)
        else:
            figure = figures.layer_head_figure(
                values, self.layer_labels, name, self.log_scale_shown
            )
            plot = static.figure_html(figure, f"{name} per layer and head")
        return plot + self._summary_html()
