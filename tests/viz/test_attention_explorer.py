"""AttentionExplorer: selectors pick the displayed pattern; comparison panels; static fallback."""

from __future__ import annotations

import pytest
import torch
from pngs import inline_pngs

from qlens.quant.model_quantize import quantize
from qlens.viz import AttentionExplorer


def test_layer_and_head_selectors_choose_the_displayed_pattern(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    assert torch.equal(explorer.displayed["reference"], cache["blocks.0.attn.hook_pattern"][0, 0])
    first_view = explorer.view.value
    explorer.layer.value = 1
    explorer.head.value = 2
    assert torch.equal(explorer.displayed["reference"], cache["blocks.1.attn.hook_pattern"][0, 2])
    assert explorer.view.value != first_view
    assert explorer.layer.max == 1 and explorer.head.max == 3


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


def test_display_bundle_has_the_widget_and_the_static_html(tiny_run):
    _, cache, tokens = tiny_run
    bundle = AttentionExplorer(cache, tokens)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert inline_pngs(bundle["text/html"])


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


def test_view_is_drawn_when_first_shown_then_follows_every_change(tiny_run):
    _, cache, tokens = tiny_run
    explorer = AttentionExplorer(cache, tokens)
    explorer.layer.value = 1
    assert explorer._view.value == ""  # nothing drawn before the view is shown
    assert explorer.view.value == explorer.to_html()
    explorer.head.value = 3
    assert explorer._view.value == explorer.to_html()
    assert explorer._repr_mimebundle_()["text/html"] == explorer.to_html()
