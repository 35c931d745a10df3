"""DriftDashboard: reads a drift result; the metric selector picks the displayed series."""

from __future__ import annotations

import pytest
import torch
from links import kernel_links
from pngs import inline_pngs

from qlens.analysis import quantization_drift
from qlens.modules.model_quantize import quantize
from qlens.viz import DriftDashboard
from qlens.viz.drift import read_drift

COLUMNS = {
    "scheme": "mxfp4",
    "layers": [0, 1, 2],
    "cosine": [0.999, 0.99, 0.98],
    "relative_error": [0.01, 0.05, 0.2],
    "kl": [0.0, 0.001, 0.01],
}


class _Result:
    def to_dict(self) -> dict:
        return {"scheme": "int4", "per_layer": {k: COLUMNS[k] for k in ("layers", "cosine", "kl")}}


def test_metric_selector_chooses_the_displayed_series():
    dashboard = DriftDashboard(COLUMNS)
    assert list(dashboard.metric.options) == ["cosine", "relative_error", "kl"]
    assert dashboard.displayed.tolist() == COLUMNS["cosine"]
    first = dashboard.to_html()
    dashboard.metric.value = "kl"
    assert dashboard.displayed.tolist() == COLUMNS["kl"]
    assert dashboard.to_html() != first
    assert dashboard.layer_labels == ["0", "1", "2"]


def test_drift_report_of_a_quantized_model(tiny_bridge):
    quantized = quantize(tiny_bridge, "int4", group_size=32)
    report = quantization_drift(tiny_bridge, quantized, tiny_bridge.to_tokens("a b c d a b c"))
    dashboard = DriftDashboard(report)
    assert list(dashboard.metric.options) == ["resid_cosine", "resid_rel_error", "pattern_change"]
    assert dashboard.displayed.tolist() == report.resid_cosine
    dashboard.metric.value = "pattern_change"
    assert dashboard.displayed.tolist() == report.pattern_change
    assert dashboard.displayed.shape == (2, 4)
    html = dashboard.to_html()
    assert len(inline_pngs(html)) == 1
    assert f"logit_kl = {report.logit_kl:.4g}" in html


def test_records_nested_and_to_dict_shapes_are_read():
    records = {"layers": [{"layer": i, "cosine": c} for i, c in enumerate(COLUMNS["cosine"])]}
    data = read_drift(records)
    assert data.layer_labels == ["0", "1", "2"] and data.series == {"cosine": COLUMNS["cosine"]}
    data = read_drift(_Result())
    assert data.series == {"cosine": COLUMNS["cosine"], "kl": COLUMNS["kl"]}


def test_static_fallback_and_log_scale_re_render():
    dashboard = DriftDashboard(COLUMNS, metric="relative_error")
    linear = inline_pngs(dashboard.to_html())
    dashboard.log_scale.value = True
    assert dashboard.log_scale_shown
    assert linear != inline_pngs(dashboard.to_html())
    expected = torch.tensor(COLUMNS["relative_error"], dtype=torch.float64)
    assert torch.equal(dashboard.displayed, expected)


def test_log_scale_is_disabled_where_a_metric_has_values_at_or_below_zero():
    dashboard = DriftDashboard(COLUMNS, metric="kl")  # kl starts at 0.0
    assert dashboard.log_scale.disabled
    dashboard.log_scale.value = True
    assert not dashboard.log_scale_shown
    dashboard.metric.value = "cosine"
    assert not dashboard.log_scale.disabled and dashboard.log_scale_shown
    assert dashboard.view.log_allowed == [True, True, False]


def test_every_metric_goes_to_the_browser_once():
    dashboard = DriftDashboard({**COLUMNS, "pattern_change": [[0.1, 0.2]] * 3, "logit_kl": 3e-5})
    view = dashboard.view
    assert view.metrics == ["cosine", "relative_error", "kl", "pattern_change"]
    assert view.series == {k: COLUMNS[k] for k in ("cosine", "relative_error", "kl")}
    assert view.matrices == {"pattern_change": [[0.1, 0.2]] * 3}
    assert view.scalars == {"logit_kl": 3e-5}
    assert kernel_links(dashboard) == {
        "metric": (dashboard.metric, "index"),
        "log_scale": (dashboard.log_scale, "value"),
    }


def test_bad_inputs_are_explained():
    with pytest.raises(ValueError, match="no per-layer numeric series"):
        DriftDashboard({"layers": [0, 1], "cosine": [1.0, 0.9, 0.8]})
    with pytest.raises(TypeError, match="got list"):
        DriftDashboard([1.0, 2.0])
    with pytest.raises(ValueError, match="metric 'mse' is not in the drift result"):
        DriftDashboard(COLUMNS, metric="mse")
