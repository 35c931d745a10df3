"""A viewer displays its widget, then a static fallback that follows the last selection."""

from __future__ import annotations

import asyncio
import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from pngs import inline_pngs
from traitlets.config import Config

from qlens.viz import AttentionExplorer, DriftDashboard, fallback
from qlens.viz.fallback import fallback_html

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
COLUMNS = {"layers": [0, 1, 2], "cosine": [0.999, 0.99, 0.98], "kl": [0.0, 0.001, 0.01]}


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """An IPython shell for ``display`` to publish through (its files in a temporary directory,
    no history); removed afterwards, with the hooks it installed."""
    if InteractiveShell.initialized():
        yield InteractiveShell.instance()
        return
    hooks = sys.displayhook, sys.excepthook
    config = Config()
    config.HistoryManager.enabled = False
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
        yield InteractiveShell.instance(config=config)
    InteractiveShell.clear_instance()
    sys.displayhook, sys.excepthook = hooks


def _html(output) -> str:
    return output.data["text/html"]


def test_the_display_is_the_widget_then_the_fallback(shell, tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    with capture_output() as shown:
        explorer._ipython_display_()
    widget, static = shown.outputs
    assert widget.data[WIDGET_VIEW]["model_id"] == explorer.view.model_id
    assert list(widget.data) == [WIDGET_VIEW, "text/plain"]  # no text/html to render twice
    view_id = explorer.view.static_id
    assert static.transient["display_id"] and not static.update
    assert _html(static) == fallback_html(view_id, {"layer": 0, "head": 0}, explorer.to_html())


def test_a_browser_selection_updates_every_displayed_fallback(shell, tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    with capture_output() as shown:
        explorer._ipython_display_()
        explorer._ipython_display_()  # shown twice: both copies follow
        first = [_html(o) for o in shown.outputs[1::2]]
        explorer.view.head = 2  # as the browser's input sets it (no event loop: at once)
    updates = [o for o in shown.outputs if o.update]
    assert len(updates) == 2
    assert {o.transient["display_id"] for o in updates} == {
        o.transient["display_id"] for o in shown.outputs[1:4:2]
    }
    assert explorer.head.value == 2
    for update, before in zip(updates, first, strict=True):
        assert 'data-layer="0" data-head="2"' in _html(update)
        assert inline_pngs(_html(update)) != inline_pngs(before)


def test_changes_in_a_burst_re_render_once_after_they_pause(shell, monkeypatch):
    monkeypatch.setattr(fallback, "UPDATE_DELAY_S", 0.05)
    dashboard = DriftDashboard(COLUMNS)

    async def burst() -> None:
        dashboard.view.metric = 1
        dashboard.view.metric = 0
        dashboard.view.log_scale = True
        await asyncio.sleep(0.3)

    with capture_output() as shown:
        dashboard._ipython_display_()
        asyncio.run(burst())
    updates = [o for o in shown.outputs if o.update]
    assert len(updates) == 1
    assert 'data-metric="0" data-log-scale="true"' in _html(updates[0])
    assert dashboard.log_scale.value and dashboard.log_scale_shown


def test_a_closed_viewer_displays_only_its_fallback(shell):
    dashboard = DriftDashboard(COLUMNS)
    dashboard.view.close()
    with capture_output() as shown:
        dashboard._ipython_display_()
    (static,) = shown.outputs
    assert inline_pngs(_html(static))


def test_the_fallback_hides_an_unrendered_widget_in_jupyterlab():
    html = fallback_html("abc123", {"top_k": 4, "log_scale": False}, "<p>body</p>")
    assert html.startswith('<div class="qlens-static" data-view="abc123" data-top-k="4" ')
    assert 'data-log-scale="false">' in html and html.endswith("<p>body</p></div>")
    rule = (
        '.jp-OutputArea-child:has(+ .jp-OutputArea-child .qlens-static[data-view="abc123"])'
        ":not(:has(.qlens-viewer)) { display: none; }"
    )
    assert f"<style>{rule}</style>" in html
