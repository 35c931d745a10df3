"""The static fallback a viewer displays next to its widget: the view of the *last* selection.

A viewer's display is two outputs: the widget, then this static HTML (inline PNG, no scripts)
under a display id. Where the widget is drawn, the viewer's JavaScript hides the fallback;
where it cannot be drawn (no kernel, an untrusted notebook, nbconvert, GitHub), the fallback
shows instead, and in JupyterLab its own style rule hides the widget output's "Loading
widget..." text. Each change of the selection re-renders the fallback in the kernel (once the
changes pause) and updates the displayed output, so a saved notebook keeps the last view.
"""

from __future__ import annotations

import asyncio
import html
import uuid
from collections.abc import Callable, Mapping
from typing import Any

# Selection changes closer together than this re-render the fallback once, after the last one.
UPDATE_DELAY_S = 0.5

STATIC_CLASS = "qlens-static"


def attribute_value(value: Any) -> str:
    """A trait value as the text of an HTML data attribute (booleans as ``true``/``false``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def fallback_html(view_id: str, selection: Mapping[str, Any], body: str) -> str:
    """``body`` wrapped for display next to the widget ``view_id``: the selection it shows as
    ``data-*`` attributes, and (for JupyterLab without a kernel) a rule that hides the widget
    output right before it while that output holds no drawn viewer."""
    attributes = "".join(
        f' data-{html.escape(name.replace("_", "-"))}="{html.escape(attribute_value(value))}"'
        for name, value in selection.items()
    )
    hide_unrendered_widget = (
        f'.jp-OutputArea-child:has(+ .jp-OutputArea-child .{STATIC_CLASS}[data-view="{view_id}"])'
        ":not(:has(.qlens-viewer)) { display: none; }"
    )
    return (
        f'<div class="{STATIC_CLASS}" data-view="{view_id}"{attributes}>'
        f"<style>{hide_unrendered_widget}</style>{body}</div>"
    )


class StaticFallback:
    """The displayed fallback outputs of one viewer, re-rendered after selection changes.

    ``body`` gives the static view of the current selection, ``selection`` that selection.
    ``display`` shows the fallback under a new display id; ``schedule_update`` re-renders every
    displayed copy once the changes pause (at once where no event loop runs, e.g. outside a
    kernel).
    """

    def __init__(self, body: Callable[[], str], selection: Callable[[], Mapping[str, Any]]):
        self.view_id = uuid.uuid4().hex
        self._body = body
        self._selection = selection
        self._handles: list[Any] = []
        self._pending: asyncio.TimerHandle | None = None

    def bundle(self) -> dict[str, str]:
        """The display bundle of the fallback: its HTML for the current selection."""
        return {"text/html": fallback_html(self.view_id, self._selection(), self._body())}

    def display(self) -> None:
        from IPython.display import display

        self._handles.append(display(self.bundle(), raw=True, display_id=True))

    def schedule_update(self, _change: object = None) -> None:
        if not self._handles:
            return
        if self._pending is not None:
            self._pending.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.update()
            return
        self._pending = loop.call_later(UPDATE_DELAY_S, self.update)

    def update(self) -> None:
        """Re-render the fallback now and update every displayed copy."""
        self._pending = None
        bundle = self.bundle()
        for handle in self._handles:
            handle.update(bundle, raw=True)
