"""The base of every viewer: ipywidgets controls plus a static HTML rendering of the same view."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets


class Viewer:
    """A widget (``self.widget``) whose selectors re-render the view when they change.

    Subclasses build their selectors, call ``_finish(selectors)`` and implement ``_render_html``
    (the current view as static HTML). In a notebook the viewer shows as the live widget;
    frontends without widget support (exported HTML, GitHub) show the static rendering instead,
    because both are in the display bundle. The view is drawn when first shown (or read through
    ``view``/``widget``) and redrawn on every selector change after that, so setting several
    selectors before display costs one drawing.
    """

    def _finish(self, selectors: list[widgets.Widget]) -> None:
        self._view = widgets.HTML()
        self._widget = widgets.VBox([widgets.HBox(selectors), self._view])
        self._live = False
        for selector in selectors:
            selector.observe(self._on_change, names="value")

    @property
    def view(self) -> widgets.HTML:
        """The widget holding the drawn view (drawn on first access)."""
        if not self._live:
            self.refresh()
        return self._view

    @property
    def widget(self) -> widgets.VBox:
        """Selectors above the view, ready to display."""
        if not self._live:
            self.refresh()
        return self._widget

    def _on_change(self, _change: dict[str, Any]) -> None:
        if self._live:
            self.refresh()

    def refresh(self) -> None:
        """Redraw the view from the current selector values."""
        self._live = True
        try:
            self._view.value = self._render_html()
        except (ValueError, KeyError) as error:
            self._view.value = f"<pre>{html.escape(str(error))}</pre>"

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
        bundle["text/html"] = self.view.value
        return bundle
