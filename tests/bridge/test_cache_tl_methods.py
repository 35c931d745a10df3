"""ActivationCache's TransformerLens methods: their errors, TL's shorthand names, slices, and the
exact attribution qlens adds (norm_weight=True). Values against TL: test_tl_oracle_tiny.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from bridge_models import tiny_model

from qlens.analysis.slicing import Slice
from qlens.bridge import ActivationCache, Bridge

TOKENS = torch.tensor([[5, 17, 301, 42, 9, 7], [8, 1, 30, 420, 99, 3]])


@pytest.fixture(scope="module")
def llama_run() -> tuple[Bridge, torch.Tensor, ActivationCache]:
    model = copy.deepcopy(tiny_model("llama"))
    with torch.no_grad():  # norm weights other than 1, as in trained models
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    bridge = Bridge(model)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(TOKENS)
    return bridge, logits, cache


def test_transformer_lens_shorthand_names(llama_run) -> None:  # noqa: ANN001
    _, _, cache = llama_run
    assert cache["k1"] is cache["blocks.1.attn.hook_k"]
    assert cache["scale0ln2"] is cache["blocks.0.ln2.hook_scale"]
    assert cache["attn", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["attn_logits", 0] is cache["blocks.0.attn.hook_attn_scores"]
    assert cache["mlp_post", 1] is cache["blocks.1.mlp.hook_post"]
    assert cache["value", 0, "a"] is cache["blocks.0.attn.hook_v"]
    assert cache["resid_pre", 1, "b"] is cache["blocks.1.hook_resid_pre"]
    assert cache.cache_dict is cache.cache and cache.has_embed and not cache.has_pos_embed


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, slice(None)),
        (2, 2),
        (np.int64(-1), -1),
        (torch.tensor(3), 3),
        ((3,), slice(3)),
        ((1, 5), slice(1, 5)),
        ((1, 5, 2), slice(1, 5, 2)),
        (slice(0, 2), slice(0, 2)),
        ([0, 2], [0, 2]),
        (torch.tensor([3, 1]), [3, 1]),
        (np.array([1, 3]), [1, 3]),
    ],
)
def test_slices_index_as_transformer_lens_does(given, expected) -> None:  # noqa: ANN001
    x = torch.arange(60).reshape(3, 4, 5)
    assert torch.equal(Slice(given).apply(x, 1), x[:, expected])
    assert torch.equal(Slice(Slice(given)).apply(x, -1), x[..., expected])


@pytest.mark.parametrize("bad", [1.5, "a", [0.5], True, [[0, 1]]])
def test_bad_slices_are_refused(bad) -> None:  # noqa: ANN001
    with pytest.raises((TypeError, ValueError), match="slice"):
        Slice(bad)


def test_norm_weight_attributions_add_up_to_the_logits(llama_run) -> None:  # noqa: ANN001
    bridge, logits, cache = llama_run
    stack = cache.decompose_resid(pos_slice=-1)
    right, wrong = torch.tensor([3, 4]), torch.tensor([7, 7])
    exact = cache.logit_attrs(stack, right, wrong, pos_slice=-1, norm_weight=True).sum(0)
    diff = logits[:, -1].gather(1, right[:, None]) - logits[:, -1].gather(1, wrong[:, None])
    torch.testing.assert_close(exact, diff[:, 0], rtol=1e-5, atol=1e-5)
    as_tl = cache.logit_attrs(stack, right, wrong, pos_slice=-1).sum(0)
    assert (as_tl - diff[:, 0]).abs().max() > 1e-3  # the tiny model's norm weights are not 1


def test_errors_say_what_to_do(llama_run) -> None:  # noqa: ANN001
    bridge, _, cache = llama_run
    detached = ActivationCache(dict(cache.items()), cache.n_layers)
    with pytest.raises(ValueError, match="built without its bridge.*run_with_cache"):
        detached.decompose_resid()
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\], or None or -1"):
        cache.accumulated_resid(layer=3)
    with pytest.raises(ValueError, match="mlp_input=True needs a layer below n_layers"):
        cache.decompose_resid(mlp_input=True)
    with pytest.raises(ValueError, match="same shape"):
        cache.logit_attrs(cache.decompose_resid(pos_slice=-1), torch.tensor([1, 2]), 3, -1)
    with pytest.raises(ValueError, match="project_output_onto must be"):
        cache.get_neuron_results(0, project_output_onto=torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="batch of 2.*apply_slice_to_batch_dim"):
        cache.remove_batch_dim(batch_size=2)
    one = cache.apply_slice_to_batch_dim(0)
    assert not one.has_batch_dim and one["embed"].shape == (6, 64)
    with pytest.raises(ValueError, match="this cache has none"):
        one.apply_slice_to_batch_dim(0)


def test_head_results_and_stacks_add_up(llama_run) -> None:  # noqa: ANN001
    _, _, cache = llama_run
    copy = cache.apply_slice_to_batch_dim(None)
    copy.compute_head_results()
    assert copy["result", 0].shape == (2, 6, 4, 64)
    heads, labels = copy.stack_head_results(layer=1, incl_remainder=True, return_labels=True)
    assert labels == ["L0H0", "L0H1", "L0H2", "L0H3", "remainder"]
    torch.testing.assert_close(heads.sum(0), cache["resid_pre", 1], rtol=1e-5, atol=1e-5)
    neurons = cache.stack_neuron_results(layer=1, incl_remainder=True, mlp_input=True)
    torch.testing.assert_close(neurons.sum(0), cache["resid_mid", 1], rtol=1e-5, atol=1e-5)
    assert cache.stack_head_results(layer=0).shape == (0, 2, 6, 64)
    assert cache.stack_activation("resid_post", layer=1).shape == (1, 2, 6, 64)
