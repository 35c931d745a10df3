"""Every viewer in JupyterLab with Chromium: it renders as a widget with its own selectors,
reacts in the browser without the kernel, shows the static view of its last selection when
reopened without a kernel or untrusted, and nothing leaves 127.0.0.1. The report page fits 1280
and 800 px windows.

The tests record each viewer's load and interaction times; ``QLENS_VIEWER_TIMINGS=path`` writes
them there as JSON (``benchmarks/viewer_latency.py`` runs this module and tabulates them against
the targets; times are measured, never asserted, here).

One JupyterLab server and one notebook (docs/viewers.md's cells) serve the whole module.
Screenshots go to the directory printed at the start (``QLENS_ARTIFACTS`` to choose it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest
from lab_server import jupyterlab
from viewer_notebook import write_notebook

pytestmark = pytest.mark.browser

VIEWERS = {
    "attention": ".qlens-attention",
    "logit_lens": ".qlens-lens",
    "activations": ".qlens-activations",
    "drift": ".qlens-drift",
}
BROKEN_TEXT = ("Loading widget", "Error displaying widget", "object at 0x", "model not found")
RUN_CELLS_TIMEOUT_MS = 240_000
SAVE_TIMEOUT_S = 180
# Every measured time (ms), written out by `_timings_file` when the module ends.
TIMINGS: dict[str, float] = {}
LOADS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _timings_file():
    """Write the measured times to ``QLENS_VIEWER_TIMINGS`` (if set) once the module ran."""
    yield
    target = os.environ.get("QLENS_VIEWER_TIMINGS")
    if target:
        report = {"load_ms": LOADS, "interaction_ms": TIMINGS, "load_average": os.getloadavg()}
        Path(target).write_text(json.dumps(report, indent=1))


KERNEL_DIALOG_MS = 15_000
# The kernel re-renders a fallback half a second after the last selection change (a matplotlib
# figure: up to a few seconds on a loaded machine).
FALLBACK_UPDATE_MS = 60_000

# In-page timing: run an input, then resolve after the next paint.
TIME_TO_PAINT = """async (action) => {
  const started = performance.now();
  (new Function(action))();
  await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
  return performance.now() - started;
}"""


class Offsite:
    """Every request the page makes to a host other than 127.0.0.1 (each one is aborted)."""

    def __init__(self, page) -> None:
        self.urls: list[str] = []
        page.route("**/*", self._route)
        page.on("websocket", lambda socket: self._check(socket.url))

    def _check(self, url: str) -> bool:
        host = urlparse(url).hostname
        if url.startswith(("data:", "blob:", "file:")) or host == "127.0.0.1":
            return True
        self.urls.append(url)
        return False

    def _route(self, route) -> None:
        if self._check(route.request.url):
            route.continue_()
        else:
            route.abort()


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab") / "root"
    root.mkdir()
    write_notebook(root / "viewers.ipynb")
    with jupyterlab(root) as running:
        yield running


@pytest.fixture(scope="module")
def live(browser, server, artifacts):
    """The notebook open in JupyterLab with every cell run and every viewer drawn."""
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    offsite = Offsite(page)
    page.goto(server.page_url("viewers.ipynb"))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    _answer_kernel_dialog(page, "Select")
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    try:
        for selector in VIEWERS.values():
            page.wait_for_selector(selector, timeout=RUN_CELLS_TIMEOUT_MS)
    finally:
        page.screenshot(path=artifacts / "notebook_after_run.png", full_page=True)
    for selector in VIEWERS.values():
        page.wait_for_selector(f"{selector}[data-load-ms]")
    yield page, offsite
    page.close()


def _answer_kernel_dialog(page, button: str) -> None:
    """Answer JupyterLab's "Select Kernel" dialog, when it asks, with ``button`` ("Select"
    starts the notebook's kernel, "No Kernel" opens it without one)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:
        dialog.wait_for(timeout=KERNEL_DIALOG_MS)
    except PlaywrightTimeout:
        return  # JupyterLab did not ask
    dialog.get_by_role("button", name=button, exact=True).click()
    dialog.wait_for(state="detached")


def _output(page, kind: str):
    return page.locator(".jp-OutputArea-output", has=page.locator(VIEWERS[kind])).first


def _shot(page, kind: str, artifacts: Path, name: str | None = None) -> None:
    _output(page, kind).screenshot(path=artifacts / f"{name or kind}.png")


def _wait_paint_after_key(page, target, key: str, attribute: str, expected: str) -> float:
    """Press ``key`` on ``target``; the time from the keydown to the paint after the viewer's
    ``attribute`` becomes ``expected`` (measured in the page)."""
    return _time_input(page, lambda: target.press(key), "keydown", attribute, expected)


def _time_input(page, act, event: str, attribute: str, expected: str) -> float:
    """Run ``act``; the time from its ``event`` (seen first, capturing) to the paint after an
    element's ``attribute`` becomes ``expected`` (measured in the page)."""
    page.evaluate(
        """([event, attribute, expected]) => {
          window.qlensKeyTime = new Promise((resolve, reject) => {
            setTimeout(() => reject(new Error(`no ${attribute}="${expected}" after ${event}`)), 30000);
            let started = null;
            const onKey = () => { started = performance.now(); };
            document.addEventListener(event, onKey, { capture: true, once: true });
            const check = () => {
              const node = document.querySelector(`[${attribute}="${expected}"]`);
              if (node && started !== null) {
                requestAnimationFrame(() => setTimeout(() => resolve(performance.now() - started), 0));
              } else {
                requestAnimationFrame(check);
              }
            };
            check();
          });
        }""",
        [event, attribute, expected],
    )
    act()
    return float(page.evaluate("() => window.qlensKeyTime"))


def _fallback(page, selection: dict[str, str]):
    """The static fallback showing ``selection`` (``data-*`` attributes of its root)."""
    attributes = "".join(f"[data-{name}='{value}']" for name, value in selection.items())
    return page.locator(f".qlens-static{attributes}")


def _wait_for_fallback(page, selection: dict[str, str]) -> None:
    """Wait until the kernel has re-rendered a static fallback for ``selection`` (the last
    selection made in the browser); while its widget is drawn it stays hidden."""
    fallback = _fallback(page, selection)
    fallback.wait_for(state="attached", timeout=FALLBACK_UPDATE_MS)
    assert fallback.is_hidden()


def test_every_viewer_renders_as_a_widget(live, artifacts):
    page, offsite = live
    text = page.locator(".jp-NotebookPanel").inner_text()
    for broken in BROKEN_TEXT:
        assert broken not in text
    # Each viewer's static fallback follows it and stays hidden while the widget is drawn.
    fallbacks = page.locator(".qlens-static")
    fallbacks.nth(len(VIEWERS) - 1).wait_for(state="attached")  # rendered after each widget
    assert fallbacks.count() == len(VIEWERS)
    assert all(fallbacks.nth(i).is_hidden() for i in range(len(VIEWERS)))
    loads = {}
    for kind, selector in VIEWERS.items():
        node = page.locator(selector)
        assert node.count() == 1
        loads[kind] = float(node.get_attribute("data-load-ms"))
        box = node.bounding_box()
        output_box = _output(page, kind).bounding_box()
        assert box["width"] <= output_box["width"] + 1, f"{kind} is wider than its output"
        _shot(page, kind, artifacts)
    print(f"\nviewer load (ms, first drawing to paint): {json.dumps(loads)}")
    LOADS.update(loads)
    assert offsite.urls == []


def test_attention_explorer_reacts_in_the_browser(live, artifacts):
    page, _ = live
    root = page.locator(".qlens-attention")
    assert root.get_attribute("data-head") == "0"
    # A click on head 2's thumbnail selects it; the viewer's head slider follows.
    thumb_ms = page.evaluate(
        TIME_TO_PAINT, "document.querySelectorAll('.qlens-attention .qlens-thumb')[2].click()"
    )
    assert root.get_attribute("data-head") == "2"
    # The head slider follows the click; its readout too.
    assert page.locator(".qlens-attention input[data-trait='head']").input_value() == "2"
    assert page.locator(".qlens-attention .qlens-readout").nth(1).inner_text() == "2"
    hover_ms = page.evaluate(
        TIME_TO_PAINT,
        "document.querySelectorAll('.qlens-attention .qlens-token')[100]"
        ".dispatchEvent(new MouseEvent('mouseenter'))",
    )
    hovered = page.locator(".qlens-attention .qlens-token.qlens-hovered")
    assert hovered.count() == 1
    coloured = page.locator(".qlens-attention .qlens-token[title]").count()
    assert coloured == 128  # every token shows its attention from the hovered one
    _shot(page, "attention", artifacts, "attention_explorer")
    layer = page.locator(".qlens-attention input[data-trait='layer']")
    slider_ms = _wait_paint_after_key(page, layer, "ArrowRight", "data-layer", "1")
    _wait_for_fallback(page, {"layer": "1", "head": "2"})
    TIMINGS.update(
        {
            "attention head click": thumb_ms,
            "attention token hover": hover_ms,
            "attention layer slider": slider_ms,
        }
    )


def test_logit_lens_reacts_in_the_browser(live, artifacts):
    page, _ = live
    root = page.locator(".qlens-lens")
    assert root.get_attribute("data-position") == "127"
    scroll = page.locator(".qlens-lens .qlens-scroll").first
    assert scroll.evaluate("(node) => node.scrollWidth > node.clientWidth")  # 128 columns scroll
    click_ms = page.evaluate(
        TIME_TO_PAINT,
        "document.querySelectorAll('.qlens-lens .qlens-grid tbody tr')[3]"
        ".querySelectorAll('td')[40].click()",
    )
    assert root.get_attribute("data-position") == "40"
    # One box outlines the column: from the header over every layer's cell (30 blocks + final).
    mark = page.locator(".qlens-lens .qlens-column-mark").bounding_box()
    header = page.locator(".qlens-lens .qlens-grid th.qlens-pos").nth(40).bounding_box()
    rows = page.locator(".qlens-lens .qlens-grid tr")
    assert rows.count() == 1 + 31
    last_cell = rows.nth(31).locator("td").nth(40).bounding_box()
    assert abs(mark["x"] - header["x"]) < 1 and abs(mark["width"] - header["width"]) < 1
    assert mark["y"] <= header["y"] and mark["y"] + mark["height"] >= last_cell["y"] + 1
    rows_before = page.locator(".qlens-lens .qlens-topk tr").first.locator("th").count()
    assert page.locator(".qlens-lens select[data-trait='position']").input_value() == "40"
    slider = page.locator(".qlens-lens input[data-trait='top_k']")
    top_k_ms = _wait_paint_after_key(page, slider, "ArrowLeft", "data-top-k", "4")
    rows_after = page.locator(".qlens-lens .qlens-topk tr").first.locator("th").count()
    assert (rows_before, rows_after) == (1 + 5, 1 + 4)
    _shot(page, "logit_lens", artifacts)
    _wait_for_fallback(page, {"position": "40", "top-k": "4"})
    TIMINGS.update({"logit lens position click": click_ms, "logit lens top-k slider": top_k_ms})


def test_activation_heatmap_reacts_in_the_browser(live, artifacts):
    page, _ = live
    root = page.locator(".qlens-activations")
    assert root.get_attribute("data-shown") == "neuron 0"
    before = page.locator(".qlens-activations .qlens-token").first.evaluate(
        "(node) => node.style.background"
    )
    box = page.locator(".qlens-activations input[data-trait='neuron']")
    neuron_ms = _wait_paint_after_key(page, box, "ArrowUp", "data-shown", "neuron 1")
    after = page.locator(".qlens-activations .qlens-token").first.evaluate(
        "(node) => node.style.background"
    )
    assert before != after
    hover_ms = page.evaluate(
        TIME_TO_PAINT,
        "document.querySelectorAll('.qlens-activations .qlens-token')[5]"
        ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))",
    )
    tip = page.locator(".qlens-activations .qlens-tip")
    assert tip.is_visible() and tip.inner_text().startswith("5 ")
    _shot(page, "activations", artifacts, "activation_heatmap")
    # Another layer's hook: the browser asks the kernel, which sends that hook's values.
    assert root.get_attribute("data-hook") == "blocks.0.hook_resid_post"
    page.locator(".qlens-activations select[data-trait='hook-layer']").select_option("1")
    kind = page.locator(".qlens-activations select[data-trait='hook-kind']")
    assert kind.input_value() == "hook_resid_post"  # the kind is kept
    page.wait_for_selector(".qlens-activations[data-hook='blocks.1.hook_resid_post']")
    assert page.locator(".qlens-activations .qlens-message").inner_text() == ""
    after_hook = page.locator(".qlens-activations .qlens-token").first.evaluate(
        "(node) => node.style.background"
    )
    assert after_hook != after and root.get_attribute("data-shown") == "neuron 1"
    _wait_for_fallback(page, {"hook": "blocks.1.hook_resid_post", "neuron": "1"})
    TIMINGS.update({"activations neuron box": neuron_ms, "activations token hover": hover_ms})


def test_drift_dashboard_reacts_in_the_browser(live, artifacts):
    page, _ = live
    root = page.locator(".qlens-drift")
    assert root.get_attribute("data-metric") == "pattern_change"
    assert page.locator(".qlens-drift .qlens-matrix td").count() == 30 * 4
    headers = page.locator(".qlens-drift .qlens-matrix th")
    assert headers.first.inner_text() == "layer \\ head"
    _shot(page, "drift", artifacts, "drift_dashboard")
    checkbox = page.locator(".qlens-drift input[data-trait='log_scale']")
    log_ms = _time_input(page, checkbox.click, "click", "data-log", "true")
    _wait_for_fallback(page, {"log-scale": "true"})
    TIMINGS.update({"drift log scale": log_ms})


_SAVED: list[Path] = []


def _saved_notebook(live, server) -> Path:
    """Save the live notebook once, after the interactions (JupyterLab writes the widget state,
    with every selection made, into it) and return it."""
    if _SAVED:
        return _SAVED[0]
    page, _ = live
    saved = server.root / "viewers.ipynb"
    before = saved.stat().st_mtime_ns
    deadline = time.monotonic() + SAVE_TIMEOUT_S
    while saved.stat().st_mtime_ns == before or "widget-state+json" not in saved.read_text():
        assert time.monotonic() < deadline, "the notebook was not saved with its widget state"
        # Focus the notebook (a widget's input may hold the keyboard), then Ctrl+S; the first
        # press after the interactions is sometimes taken by the focus change, so repeat it.
        page.locator(".jp-NotebookPanel .jp-InputPrompt").first.click()
        page.keyboard.press("Control+s")
        for _ in range(30):
            if saved.stat().st_mtime_ns != before:
                break
            time.sleep(0.5)
    _SAVED.append(saved)
    return saved


@pytest.fixture(scope="module")
def kernelless(tmp_path_factory):
    """A second JupyterLab that has no kernel to start: notebooks open as saved."""
    root = tmp_path_factory.mktemp("lab-no-kernel") / "root"
    root.mkdir()
    with jupyterlab(root, extra=["--KernelSpecManager.allowed_kernelspecs=qlens-none"]) as running:
        yield running


def _open_without_kernel(browser, server, name: str):
    """Open ``name`` in a new page of the kernel-less server."""
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    offsite = Offsite(page)
    page.goto(server.page_url(name))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    _answer_kernel_dialog(page, "No Kernel")
    return page, offsite


def _copy_without_kernel(saved: Path, target: Path) -> None:
    notebook = nbformat.read(saved, as_version=4)
    notebook.metadata.pop("kernelspec", None)
    nbformat.write(notebook, target)


# The selections the interaction tests above leave, as each viewer's fallback records them.
LAST_SELECTIONS = [
    {"layer": "1", "head": "2"},
    {"position": "40", "top-k": "4"},
    {"neuron": "1"},
    {"log-scale": "true"},
]
# The widget output of a viewer: the output right before its static fallback.
WIDGET_OUTPUT = ".jp-OutputArea-child:has(+ .jp-OutputArea-child .qlens-static)"


def test_reopened_without_a_kernel_the_last_views_show(
    live, server, kernelless, browser, artifacts
):
    # JupyterLab 4.6 with ipywidgets 8.1 restores no widget without a kernel (its widget manager
    # waits for one): each viewer's static fallback, re-rendered by the kernel after the last
    # selection, shows instead, and hides the widget output's "Loading widget...".
    saved = _saved_notebook(live, server)
    _copy_without_kernel(saved, kernelless.root / "reopened.ipynb")
    # The user's own notebook is trusted (JupyterLab signs what it saves; so does this).
    subprocess.run(
        [sys.executable, "-m", "jupyter", "trust", str(kernelless.root / "reopened.ipynb")],
        check=True,
        capture_output=True,
        env=kernelless.env,
    )
    page, offsite = _open_without_kernel(browser, kernelless, "reopened.ipynb")
    try:
        for selection in LAST_SELECTIONS:
            _fallback(page, selection).wait_for(timeout=60_000)
    finally:
        page.screenshot(path=artifacts / "reopened.png", full_page=True)
    text = page.locator(".jp-NotebookPanel").inner_text()
    for broken in BROKEN_TEXT:
        assert broken not in text
    assert "No Kernel" in page.locator(".jp-NotebookPanel-toolbar").inner_text()
    widget_outputs = page.locator(WIDGET_OUTPUT)
    assert widget_outputs.count() == len(VIEWERS)
    for i in range(len(VIEWERS)):
        assert widget_outputs.nth(i).text_content() == "Loading widget..."  # and hidden
        assert widget_outputs.nth(i).is_hidden()
    images = page.locator(".qlens-static img[src^='data:image/png']")
    assert images.count() == len(VIEWERS)
    assert all(images.nth(i).evaluate("(img) => img.naturalWidth > 0") for i in range(4))
    assert offsite.urls == []
    page.close()


def test_reopened_untrusted_the_static_views_show(live, server, kernelless, browser, artifacts):
    saved = _saved_notebook(live, server)
    _copy_without_kernel(saved, kernelless.root / "untrusted.ipynb")
    page, offsite = _open_without_kernel(browser, kernelless, "untrusted.ipynb")
    images = page.locator(".jp-OutputArea-output img[src^='data:image/png']")
    try:
        images.nth(3).wait_for(timeout=60_000)
    finally:
        page.screenshot(path=artifacts / "reopened_untrusted.png", full_page=True)
    assert images.count() == 4  # one static view per viewer
    assert all(images.nth(i).evaluate("(img) => img.naturalWidth > 0") for i in range(4))
    text = page.locator(".jp-NotebookPanel").inner_text()
    for broken in BROKEN_TEXT:
        assert broken not in text
    assert offsite.urls == []
    page.close()


def test_html_export_shows_the_static_views_offline(live, server, browser, tmp_path):
    saved = _saved_notebook(live, server)
    out = tmp_path / "export"
    command = [sys.executable, "-m", "nbconvert", "--to", "html", "--output-dir", str(out)]
    cleared = [*command, "--ClearMetadataPreprocessor.enabled=True", str(saved)]
    subprocess.run(cleared, check=True, capture_output=True, timeout=300)
    exported = (out / "viewers.html").read_text()
    for widget_library in ("@jupyter-widgets/html-manager", "embed-amd", "unpkg.com"):
        assert widget_library not in exported
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    Offsite(page)  # offline: nbconvert's own require.js link from a CDN is aborted
    page.goto((out / "viewers.html").as_uri())
    images = page.locator("img[src^='data:image/png']")
    assert images.count() == 4  # one static view per viewer, drawn without the network
    assert all(images.nth(i).evaluate("(img) => img.naturalWidth > 0") for i in range(4))
    page.close()


def _report(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from qlens.cli import main

    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model_dir = directory / "model"
    LlamaForCausalLM(config).eval().save_pretrained(model_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="w0")
    tokenizer.save_pretrained(model_dir)
    out = directory / "report"
    args = ["report", str(model_dir), "--prompt", "w1 w2 w3 w4 w1 w2", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    return out / "report.html"


@pytest.mark.parametrize("width", [1280, 800])
def test_report_fits_the_window(browser, tmp_path, artifacts, width):
    report = _report(tmp_path)
    page = browser.new_page(viewport={"width": width, "height": 900})
    offsite = Offsite(page)
    page.goto(report.as_uri())
    overflow = page.evaluate(
        """() => {
          const page = document.scrollingElement;
          const wide = [];
          if (page.scrollWidth > page.clientWidth) wide.push(`page ${page.scrollWidth}`);
          for (const table of document.querySelectorAll("table")) {
            const box = table.getBoundingClientRect();
            const scroller = table.closest(".qlens-table-scroll");
            if (!scroller && box.right > page.clientWidth + 1) wide.push(`table ${box.right}`);
            if (scroller && scroller.getBoundingClientRect().right > page.clientWidth + 1) {
              wide.push(`scroller ${scroller.getBoundingClientRect().right}`);
            }
          }
          for (const cell of document.querySelectorAll("td, th")) {
            if (cell.getBoundingClientRect().width < 80 && cell.innerText.length > 40) {
              wide.push(`squeezed cell ${cell.getBoundingClientRect().width}: ${cell.innerText.slice(0, 30)}`);
            }
          }
          return wide;
        }"""
    )
    page.screenshot(path=artifacts / f"report_{width}.png", full_page=True)
    assert overflow == []
    assert offsite.urls == []
    page.close()
