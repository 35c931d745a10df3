"""Notebook HTML of qlens objects. ``_repr_html_`` methods call :func:`render_html`, which finds
the renderer in the viz layer when a notebook first asks, so the core layers (the bridge, its
caches, payloads) never import ``qlens.viz``."""

from __future__ import annotations

import importlib
from typing import Any

RENDERERS_MODULE = "qlens.viz.repr"


def render_html(kind: str, obj: Any) -> str:
    """``render_{kind}_html(obj)`` of the viz layer's renderers (``kind``: bridge, cache,
    payload)."""
    renderers = importlib.import_module(RENDERERS_MODULE)
    return getattr(renderers, f"render_{kind}_html")(obj)
