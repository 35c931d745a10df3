"""AttentionExplorer: selectors pick the displayed pattern; comparison panels; static fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from links import kernel_links
from pngs import inline_pngs

from qlens.modules.model_quantize import quantize
from qlens.viz import AttentionExplorer
from qlens.viz.arrays import decode_float16, decode_unit_uint8


def test_layer_and_head_selectors_choose_the_displayed_pattern(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    assert torch.equal(explorer.displayed["reference"], cache["blocks.0.attn.hook_pattern"][0, 0])
    explorer.layer.value = 1
    explorer.head.value = 2
    assert torch.equal(explorer.displayed["reference"], cache["blocks.1.attn.hook_pattern"][0, 2])
    assert explorer.layer.max == 1 and explorer.head.max == 3


def test_every_pattern_goes_to_the_browser_once_as_uint8(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    view = explorer.view
    assert (view.n_layers, view.n_heads, view.n_pos) == (2, 4, 7)
    assert view.compare == b"" and view.difference == b"" and view.labels[0] == "reference"
    assert len(view.patterns) == 2 * 4 * 7 * 7  # one byte per weight
    sent = decode_unit_uint8(view.patterns, (2, 4, 7, 7))
    # Levels of 1/255: rounding moves a weight by at most half a level.
    assert np.abs(sent - explorer.patterns.numpy()).max() <= 0.5 / 255 + 1e-7
    assert kernel_links(explorer) == {
        "layer": (explorer.layer, "value"),
        "head": (explorer.head, "value"),
    }


def test_comparison_shows_both_patterns_and_their_difference(tiny_bridge, tiny_run):
    _, cache, tokens = tiny_run
    quantized = quantize(tiny_bridge, "int4", group_size=32)
    _, quantized_cache = quantized.run_with_cache(tiny_bridge.to_tokens("a b c d a b c"))
    explorer = AttentionExplorer(cache, tokens, compare=quantized_cache)
    explorer.layer.value = 1
    explorer.head.value = 3
    shown = explorer.displayed
    reference = cache["blocks.1.attn.hook_pattern"][0, 3]
    other = quantized_cache["blocks.1.attn.hook_pattern"][0, 3]
    assert list(shown) == ["reference", "quantized", "difference"]
    assert torch.equal(shown["quantized"], other)
    assert torch.equal(shown["difference"], other - reference)
    assert not torch.equal(other, reference)
    view = explorer.view
    difference = decode_float16(view.difference, (2, 4, 7, 7))
    expected = (explorer.compare - explorer.patterns).numpy().astype(np.float16)
    np.testing.assert_array_equal(difference, expected.astype(np.float32))
    assert decode_unit_uint8(view.compare, (2, 4, 7, 7)).shape == (2, 4, 7, 7)


def test_static_fallback_is_an_inline_png_of_the_current_selection(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    before = inline_pngs(explorer.to_html())
    explorer.head.value = 1
    after = inline_pngs(explorer.to_html())
    assert len(before) == len(after) == 1
    assert before != after
    html = explorer.to_html()
    assert "<script" not in html and 'src="http' not in html  # renders without the network


def test_display_bundles_are_the_widget_and_the_static_html(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    widget = explorer.widget_bundle()
    assert widget["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.view.model_id
    assert widget["text/plain"] == "AttentionExplorer: a live widget; its static view follows."
    assert inline_pngs(explorer.static_bundle()["text/html"])


def test_stacked_tensor_input_and_unbatched_patterns(tiny_run):
    _, cache, tokens = tiny_run
    stacked = torch.stack([cache["pattern", i][0] for i in range(2)])
    explorer = AttentionExplorer(stacked, tokens)
    explorer.layer.value, explorer.head.value = 1, 1
    assert torch.equal(explorer.displayed["reference"], stacked[1, 1])
    unbatched = {name: cache[name][0] for name in cache if name.endswith("hook_pattern")}
    assert torch.equal(AttentionExplorer(unbatched, tokens).patterns, stacked)


def test_bad_inputs_are_explained(tiny_run):
    _, cache, tokens = tiny_run
    with pytest.raises(ValueError, match="got 3 token labels for patterns over 7 positions"):
        AttentionExplorer(cache, tokens[:3])
    with pytest.raises(ValueError, match="no attention patterns found"):
        AttentionExplorer({"blocks.0.hook_resid_pre": cache["blocks.0.hook_resid_pre"]}, tokens)
    with pytest.raises(ValueError, match=r"cached for layers \[1\]"):
        AttentionExplorer({"blocks.1.attn.hook_pattern": cache["pattern", 1]}, tokens)
    with pytest.raises(ValueError, match="compare patterns have shape"):
        AttentionExplorer(cache, tokens, compare=torch.zeros(1, 4, 7, 7))


def test_a_selection_made_in_the_browser_reaches_the_kernel_controls(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    explorer.view.layer, explorer.view.head = 1, 3  # as the browser's inputs set them
    assert (explorer.layer.value, explorer.head.value) == (1, 3)
    assert explorer.selection() == {"layer": 1, "head": 3}
    default = AttentionExplorer(cache, tokens)
    assert inline_pngs(explorer.to_html()) != inline_pngs(default.to_html())
    static = explorer.static_bundle()["text/html"]
    assert 'data-layer="1" data-head="3"' in static and explorer.to_html() in static


def test_non_square_patterns_are_refused(tiny_run):
    _, _, tokens = tiny_run
    with pytest.raises(ValueError, match="3 query and 7 key positions"):
        AttentionExplorer(torch.zeros(1, 2, 3, 7), tokens)
