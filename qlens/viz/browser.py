"""The browser side of the viewers: anywidget modules shipped in ``qlens/viz/frontend``.

Each viewer's module is ``common.js`` followed by its own file (a module loaded from a string
cannot import its neighbours); every viewer shares ``viewers.css``. Nothing is fetched from the
network: the code travels with the widget state.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import anywidget
import traitlets

FRONTEND = Path(__file__).with_name("frontend")


@cache
def module_source(name: str) -> str:
    """The ES module of one viewer (``attention``, ``logit_lens``, ``activations``, ``drift``)."""
    return (FRONTEND / "common.js").read_text() + "\n" + (FRONTEND / f"{name}.js").read_text()


@cache
def stylesheet() -> str:
    """The CSS shared by every viewer."""
    return (FRONTEND / "viewers.css").read_text()


class BrowserView(anywidget.AnyWidget):
    """The drawing area of a viewer with its selectors: its data arrive once; selections
    redraw in the browser. ``static_id`` names the static fallback displayed with it (which the
    browser hides while the view is drawn)."""

    _css = traitlets.Unicode(stylesheet()).tag(sync=True)
    static_id = traitlets.Unicode().tag(sync=True)
