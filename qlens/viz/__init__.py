"""Notebook viewers (ipywidgets), their static HTML fallbacks and HTML summaries.

Every viewer shows as a live widget in Jupyter and as static HTML (inline PNG, no network)
where widgets cannot render; ``viewer.to_html()`` gives that static view.
"""

from qlens.viz.activations import ActivationHeatmap
from qlens.viz.attention import AttentionExplorer
from qlens.viz.drift import DriftDashboard
from qlens.viz.logit_lens import LogitLensTable
from qlens.viz.repr import render_bridge_html, render_cache_html, render_payload_html

__all__ = [
    "ActivationHeatmap",
    "AttentionExplorer",
    "DriftDashboard",
    "LogitLensTable",
    "render_bridge_html",
    "render_cache_html",
    "render_payload_html",
]
