"""ActivationHeatmap: hook / neuron / direction selectors pick the displayed per-token values."""

from __future__ import annotations

import pytest
import torch
from pngs import inline_pngs

from qlens import ActivationCache
from qlens.viz import ActivationHeatmap


def test_hook_and_neuron_selectors_choose_the_displayed_values(tiny_run):
    _, cache, tokens = tiny_run
    heatmap = ActivationHeatmap(cache, tokens, hook="blocks.0.hook_resid_pre")
    assert torch.equal(heatmap.displayed, cache["blocks.0.hook_resid_pre"][0, :, 0])
    heatmap.neuron.value = 5
    assert torch.equal(heatmap.displayed, cache["blocks.0.hook_resid_pre"][0, :, 5])
    first_view = heatmap.view.value
    heatmap.hook.value = "blocks.1.attn.hook_z"  # [batch pos head d_head]: head 2, dim 3
    assert heatmap.neuron.max == 4 * 8 - 1
    heatmap.neuron.value = 2 * 8 + 3
    assert torch.equal(heatmap.displayed, cache["blocks.1.attn.hook_z"][0, :, 2, 3])
    assert heatmap.view.value != first_view


def test_patterns_are_not_offered_as_per_token_hooks(tiny_run):
    _, cache, tokens = tiny_run
    options = ActivationHeatmap(cache, tokens).hook.options
    assert "blocks.0.mlp.hook_post" in options
    assert not [name for name in options if name.endswith(("hook_pattern", "hook_attn_scores"))]


def test_direction_projects_every_token(tiny_run):
    _, cache, tokens = tiny_run
    direction = torch.randn(32)
    heatmap = ActivationHeatmap(
        cache, tokens, directions={"probe": direction}, hook="blocks.1.hook_resid_post"
    )
    heatmap.feature.value = "probe"
    expected = cache["blocks.1.hook_resid_post"][0] @ direction
    torch.testing.assert_close(heatmap.displayed, expected, rtol=0, atol=0)
    heatmap.hook.value = "blocks.1.mlp.hook_post"
    with pytest.raises(ValueError, match="direction 'probe' has 32 entries but blocks.1.mlp"):
        heatmap.displayed  # noqa: B018
    assert "direction &#x27;probe&#x27; has 32 entries" in heatmap.view.value


def test_static_fallback_renders_the_current_values(tiny_run):
    _, cache, tokens = tiny_run
    heatmap = ActivationHeatmap(cache, tokens)
    before = inline_pngs(heatmap.to_html())
    heatmap.neuron.value = 7
    assert before != inline_pngs(heatmap.to_html())


def test_bad_inputs_are_explained(tiny_run):
    _, cache, tokens = tiny_run
    with pytest.raises(ValueError, match="no cached activation has a position axis of 3 tokens"):
        ActivationHeatmap(cache, tokens[:3])
    with pytest.raises(ValueError, match="hook 'blocks.0.attn.hook_pattern' is not a per-token"):
        ActivationHeatmap(cache, tokens, hook="blocks.0.attn.hook_pattern")
    with pytest.raises(ValueError, match="'neuron' is reserved"):
        ActivationHeatmap(cache, tokens, directions={"neuron": torch.ones(32)})


def test_cache_without_batch_dim(tiny_run):
    _, cache, tokens = tiny_run
    unbatched = ActivationCache(dict(cache.items()), cache.n_layers).remove_batch_dim()
    heatmap = ActivationHeatmap(unbatched, tokens, hook="blocks.0.mlp.hook_post")
    heatmap.neuron.value = 9
    assert torch.equal(heatmap.displayed, cache["blocks.0.mlp.hook_post"][0, :, 9])
