"""ActivationHeatmap: hook / neuron / direction selectors pick the displayed per-token values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from links import kernel_links
from pngs import inline_pngs

from qlens import ActivationCache
from qlens.viz import ActivationHeatmap
from qlens.viz.activations import MODEL, hook_groups
from qlens.viz.arrays import decode_float16


def test_hook_and_neuron_selectors_choose_the_displayed_values(tiny_run):
    _, cache, tokens = tiny_run
    heatmap = ActivationHeatmap(cache, tokens, hook="blocks.0.hook_resid_pre")
    assert torch.equal(heatmap.displayed, cache["blocks.0.hook_resid_pre"][0, :, 0])
    heatmap.neuron.value = 5
    assert torch.equal(heatmap.displayed, cache["blocks.0.hook_resid_pre"][0, :, 5])
    heatmap.hook.value = "blocks.1.attn.hook_z"  # [batch pos head d_head]: head 2, dim 3
    assert heatmap.neuron.max == 4 * 8 - 1
    assert (heatmap.hook_layer.value, heatmap.hook_kind.value) == ("1", "attn.hook_z")
    heatmap.neuron.value = 2 * 8 + 3
    assert torch.equal(heatmap.displayed, cache["blocks.1.attn.hook_z"][0, :, 2, 3])


def test_the_browser_gets_the_hook_values_once_and_picks_neurons_itself(tiny_run):
    _, cache, tokens = tiny_run
    heatmap = ActivationHeatmap(cache, tokens, hook="blocks.0.hook_resid_pre")
    view = heatmap.view
    values = cache["blocks.0.hook_resid_pre"][0]
    assert view.hook == "blocks.0.hook_resid_pre" and view.n_features == 32
    sent = decode_float16(view.values, (7, 32))
    np.testing.assert_array_equal(sent, values.numpy().astype(np.float16).astype(np.float32))
    links = kernel_links(heatmap)
    assert links == {
        "hook": (heatmap.hook, "value"),
        "feature": (heatmap.feature, "index"),
        "neuron": (heatmap.neuron, "value"),
    }
    heatmap.hook_layer.value = "1"  # same kind in another layer: new values from the kernel
    assert heatmap.hook.value == "blocks.1.hook_resid_pre"
    assert view.hook == view.shown_hook == heatmap.hook.value
    sent = decode_float16(view.values, (7, 32))
    expected = cache["blocks.1.hook_resid_pre"][0].numpy().astype(np.float16)
    np.testing.assert_array_equal(sent, expected.astype(np.float32))
    heatmap.hook_kind.value = "mlp.hook_post"
    assert heatmap.hook.value == "blocks.1.mlp.hook_post" and view.n_features == 64


def test_hook_picker_groups_by_layer_and_kind(tiny_run):
    _, cache, tokens = tiny_run
    heatmap = ActivationHeatmap(cache, tokens)
    groups = hook_groups(list(heatmap.features))
    assert list(heatmap.hook_layer.options) == list(groups)
    assert set(groups) == {MODEL, "0", "1"}
    assert groups["1"]["attn.hook_z"] == "blocks.1.attn.hook_z"
    assert groups[MODEL]["ln_final.hook_normalized"] == "ln_final.hook_normalized"
    assert sum(len(kinds) for kinds in groups.values()) == len(heatmap.hook.options)
    heatmap.hook_layer.value = MODEL
    assert heatmap.hook.value in groups[MODEL].values()


def test_neuron_is_disabled_while_a_direction_is_shown(tiny_run):
    _, cache, tokens = tiny_run
    assert ActivationHeatmap(cache, tokens).view.directions == []
    probed = ActivationHeatmap(cache, tokens, directions={"probe": torch.ones(32)})
    assert probed.view.directions == ["probe"]
    assert not probed.neuron.disabled
    probed.feature.value = "probe"
    assert probed.neuron.disabled
    probed.feature.value = "neuron"
    assert not probed.neuron.disabled


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
    sent = np.frombuffer(heatmap.view.projections, dtype="<f4")
    np.testing.assert_array_equal(sent, expected.numpy())  # float32, the same product
    assert heatmap.view.direction_errors == [""]
    heatmap.hook.value = "blocks.1.mlp.hook_post"
    with pytest.raises(ValueError, match="direction 'probe' has 32 entries but blocks.1.mlp"):
        heatmap.displayed  # noqa: B018
    assert "direction &#x27;probe&#x27; has 32 entries" in heatmap.to_html()
    assert heatmap.view.direction_errors[0].startswith("direction 'probe' has 32 entries")


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
