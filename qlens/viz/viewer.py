"""The base of every viewer: a :class:`BrowserView` that draws the data and its own selectors,
the selection mirrored in the kernel, and a static HTML rendering of the same view for places
without a kernel."""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import traitlets

from qlens.viz.browser import BrowserView
from qlens.viz.fallback import StaticFallback


class Viewer:
    """A :class:`BrowserView` (data, drawing and selectors, all in the browser) and, in the
    kernel, one ``ipywidgets`` control per selection (``viewer.layer.value`` etc.).

    Subclasses build their controls and view, then call ``_finish``. Each ``(control, trait,
    view_trait)`` link is a kernel-side ``traitlets.link``: a selection made in the browser
    redraws there at once and reaches the control when the kernel gets it; setting a control in
    Python redraws the browser. The controls are not displayed: the view draws its own inputs.
    ``to_html`` renders the current selection as static HTML (inline PNG, no scripts); the
    display shows it after the widget, kept up to date (see :mod:`qlens.viz.fallback`).
    """

    def _finish(self, view: BrowserView, links: list[tuple[widgets.Widget, str, str]]) -> None:
        self._browser_view = view
        self._links = [
            traitlets.link((control, trait), (view, view_trait))
            for control, trait, view_trait in links
        ]
        self._fallback = StaticFallback(self.to_html, self.selection)
        view.static_id = self._fallback.view_id
        view.observe(self._fallback.schedule_update, names=[t for _, _, t in links])

    @property
    def view(self) -> BrowserView:
        """The drawing area (an anywidget holding the viewer's data and selection)."""
        return self._browser_view

    @property
    def widget(self) -> BrowserView:
        """What displays as the live viewer: its view."""
        return self._browser_view

    def selection(self) -> dict[str, Any]:
        """The view's selection traits (``layer``, ``head``, ``position``...) and their values."""
        view = self._browser_view
        return {link.target[1]: getattr(view, link.target[1]) for link in self._links}

    def _render_html(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement _render_html")

    def to_html(self) -> str:
        """The current view as self-contained static HTML (inline PNG, no scripts)."""
        return self._render_html()

    def widget_bundle(self) -> dict[str, Any]:
        """The display bundle of the live widget (its model id and a short plain-text line)."""
        return {
            "application/vnd.jupyter.widget-view+json": self._browser_view.get_view_spec(),
            "text/plain": f"{type(self).__name__}: a live widget; its static view follows.",
        }

    def static_bundle(self) -> dict[str, str]:
        """The display bundle of the static fallback of the current selection."""
        return self._fallback.bundle()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if self._browser_view.comm is not None:  # None once closed: only the static view shows
            display(self.widget_bundle(), raw=True)
        self._fallback.display()
