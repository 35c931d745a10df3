"""The base of every viewer: ipywidgets selectors linked in the browser to a drawing area, plus
a static HTML rendering of the same view for places without a kernel."""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from qlens.viz.browser import BrowserView


class Viewer:
    """Selectors (``ipywidgets``) above a :class:`BrowserView` that draws the data.

    Subclasses build their selectors and view, then call ``_finish``. Each ``(selector, trait,
    view_trait)`` link is a ``jslink``: moving a selector redraws in the browser with no kernel
    round trip, and the kernel still sees the new value. ``to_html`` renders the current
    selection as static HTML (inline PNG, no scripts); the display bundle carries it next to the
    widget for frontends that cannot run widgets.
    """

    def _finish(
        self,
        selectors: list[widgets.Widget],
        view: BrowserView,
        links: list[tuple[widgets.Widget, str, str]],
    ) -> None:
        self._browser_view = view
        self._links = [
            widgets.jslink((selector, trait), (view, view_trait))
            for selector, trait, view_trait in links
        ]
        self._widget = widgets.VBox([widgets.HBox(selectors), view])
        self._widget.add_class("qlens-widget")

    @property
    def view(self) -> BrowserView:
        """The drawing area (an anywidget holding the viewer's data)."""
        return self._browser_view

    @property
    def widget(self) -> widgets.VBox:
        """Selectors above the drawing area, ready to display."""
        return self._widget

    def _render_html(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement _render_html")

    def to_html(self) -> str:
        """The current view as self-contained static HTML (inline PNG, no scripts)."""
        return self._render_html()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        widget_bundle = getattr(self.widget, "_repr_mimebundle_", None)  # None once closed
        bundle = (
            dict(widget_bundle(include=include, exclude=exclude) or {}) if widget_bundle else {}
        )
        bundle["text/html"] = self.to_html()
        return bundle
