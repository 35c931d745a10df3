"""Logit lens and activation-patching sweeps on a tiny model."""

from __future__ import annotations

import pytest
import torch
from analysis_models import tiny_model

from qlens import analysis
from qlens.bridge import Bridge

CLEAN = torch.tensor([[11, 52, 33, 74, 95, 16]])
CORRUPTED = CLEAN.clone()
CORRUPTED[0, 2] = 600  # one token differs


@pytest.fixture(scope="module")
def bridge():
    return Bridge(tiny_model("llama"))


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, 5] - logits[0, -1, 9]


def test_logit_lens_final_layer_is_the_model_prediction(bridge):
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(CLEAN)
    lens = analysis.logit_lens(bridge, cache, k=3)
    assert lens.labels == ["0_pre", "1_pre", "final_post"]
    assert lens.token_ids.shape == (3, 1, 3) and lens.axes == ("layer", "batch", "k")
    top = logits[:, -1].softmax(-1).topk(3)
    assert torch.equal(lens.token_ids[-1], top.indices)
    torch.testing.assert_close(lens.probs[-1], top.values)
    assert lens.to_dict()["labels"] == lens.labels


def test_residual_patching_by_position(bridge):
    with torch.no_grad():
        clean, corrupted = _metric(bridge(CLEAN)), _metric(bridge(CORRUPTED))
    result = analysis.patch_by_position(bridge, CLEAN, CORRUPTED, _metric)
    assert result.axes == ("layer", "pos") and result.shape == (2, 6)
    assert result.labels["pos"] == [str(p) for p in range(6)]
    # Layer 0's input differs only at the changed token: patching it there restores the clean run.
    torch.testing.assert_close(result.values[0, 2], clean.float(), atol=1e-5, rtol=0)
    unchanged = result.values[0, torch.tensor([0, 1, 3, 4, 5])]
    torch.testing.assert_close(unchanged, corrupted.float().expand(5), atol=1e-5, rtol=0)
    # Before the changed token, both runs are identical at every layer.
    torch.testing.assert_close(
        result.values[:, :2], corrupted.float().expand(2, 2), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("site", ["attn_out", "mlp_out"])
def test_output_patching_before_the_change_is_a_no_op(bridge, site):
    with torch.no_grad():
        corrupted = _metric(bridge(CORRUPTED))
    result = analysis.patch_by_position(bridge, CLEAN, CORRUPTED, _metric, site=site)
    torch.testing.assert_close(
        result.values[:, :2], corrupted.float().expand(2, 2), atol=1e-5, rtol=0
    )


def test_head_patching_matches_patching_the_head_result(bridge):
    result = analysis.patch_heads(bridge, CLEAN, CORRUPTED, _metric)
    assert result.shape == (2, bridge.cfg.n_heads)
    name = "blocks.1.attn.hook_result"  # per-head outputs z_h @ W_O[h]: an independent route
    with torch.no_grad():
        _, clean = bridge.run_with_cache(CLEAN, names_filter=[name])

        def patch(x, hook):
            x = x.clone()
            x[..., 2, :] = clean[name][..., 2, :]
            return x

        expected = _metric(bridge.run_with_hooks(CORRUPTED, fwd_hooks=[(name, patch)]))
    torch.testing.assert_close(result.values[1, 2], expected.float(), atol=1e-5, rtol=0)


def test_patching_needs_matching_inputs(bridge):
    with pytest.raises(ValueError, match="must have the same shape"):
        analysis.patch_heads(bridge, CLEAN, CLEAN[:, :4], _metric)
    with pytest.raises(ValueError, match="site must be"):
        analysis.patch_by_position(bridge, CLEAN, CORRUPTED, _metric, site="resid_mid")
    with pytest.raises(ValueError, match="the metric must return a scalar"):
        analysis.patch_heads(bridge, CLEAN, CORRUPTED, lambda logits: logits[0, -1])


def test_logit_diff_metric():
    logits = torch.zeros(2, 3, 10)
    logits[:, -1, 4] = torch.tensor([3.0, 5.0])
    metric = analysis.logit_diff_metric(4, 1)
    torch.testing.assert_close(metric(logits), torch.tensor(4.0))


def _one_forward_per_location(bridge, name, patch_rows):
    """The corrupted run's metric with ``patch_rows(x, clean)`` applied in one forward."""
    with torch.no_grad():
        _, clean = bridge.run_with_cache(CLEAN, names_filter=[name])

        def patch(x, hook):
            x = x.clone()
            patch_rows(x, clean[name])
            return x

        return _metric(bridge.run_with_hooks(CORRUPTED, fwd_hooks=[(name, patch)]))


@pytest.mark.parametrize("site", ["resid_pre", "mlp_out"])
def test_batched_position_sweeps_equal_one_forward_per_location(bridge, site):
    sweeps = [
        analysis.patch_by_position(bridge, CLEAN, CORRUPTED, _metric, site, batch_size=size)
        for size in (1, 5, 64)  # one per forward, uneven chunks, everything in one forward
    ]
    for sweep in sweeps[1:]:
        # The same math over a larger batch: BLAS may block it differently (last-ulp changes).
        torch.testing.assert_close(sweep.values, sweeps[0].values, rtol=0, atol=1e-6)
    for layer, pos in [(0, 2), (1, 3), (1, 5)]:

        def at_pos(x, clean, pos=pos):
            x[:, pos] = clean[:, pos]

        expected = _one_forward_per_location(bridge, f"blocks.{layer}.hook_{site}", at_pos)
        assert float(sweeps[0].values[layer, pos]) == float(expected)


def test_batched_head_sweeps_equal_one_forward_per_location(bridge):
    sweeps = [
        analysis.patch_heads(bridge, CLEAN, CORRUPTED, _metric, batch_size=size)
        for size in (1, 3, 64)
    ]
    for sweep in sweeps[1:]:
        # The same math over a larger batch: BLAS may block it differently (last-ulp changes).
        torch.testing.assert_close(sweep.values, sweeps[0].values, rtol=0, atol=1e-6)

    def head_1(x, clean):
        x[..., 1, :] = clean[..., 1, :]

    expected = _one_forward_per_location(bridge, "blocks.0.attn.hook_z", head_1)
    assert float(sweeps[0].values[0, 1]) == float(expected)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        analysis.patch_heads(bridge, CLEAN, CORRUPTED, _metric, batch_size=0)


def test_batched_sweeps_patch_each_row_of_a_batch(bridge):
    clean = torch.cat([CLEAN, CLEAN.flip(-1)])
    corrupted = clean.clone()
    corrupted[:, 2] = torch.tensor([600, 700])
    metric = analysis.logit_diff_metric(torch.tensor([5, 6]), torch.tensor([9, 8]))
    one = analysis.patch_by_position(bridge, clean, corrupted, metric, batch_size=1)
    batched = analysis.patch_by_position(bridge, clean, corrupted, metric, batch_size=4)
    torch.testing.assert_close(batched.values, one.values, rtol=0, atol=1e-6)
    with torch.no_grad():
        restored = metric(bridge(clean))  # patching layer 0's input at the changed token
    torch.testing.assert_close(batched.values[0, 2], restored.float(), atol=1e-5, rtol=0)
