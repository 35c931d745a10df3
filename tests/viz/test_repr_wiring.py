"""Notebooks render the bridge, its caches and payloads through qlens.viz.repr."""

import torch

from qlens.formatting import format_bytes
from qlens.quant.quantize import quantize_weight
from qlens.viz.repr import render_bridge_html, render_cache_html, render_payload_html


def test_repr_html_delegates_to_the_renderers(tiny_bridge, tiny_run) -> None:
    bridge, (_, cache, _) = tiny_bridge, tiny_run
    payload = quantize_weight(torch.randn(8, 64), "mxfp4")
    assert bridge._repr_html_() == render_bridge_html(bridge)
    assert cache._repr_html_() == render_cache_html(cache)
    assert payload._repr_html_() == render_payload_html(payload)
    assert "blocks.0.hook_resid_pre" in cache._repr_html_()
    assert "mxfp4" in payload._repr_html_()


def test_format_bytes_units() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"
    assert format_bytes(5 * 1024**3) == "5.0 GiB"
