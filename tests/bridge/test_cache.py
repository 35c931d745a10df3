"""ActivationCache: lookups, shorthands, errors, stacks, batch handling, summaries."""

from __future__ import annotations

import pytest
import torch
from bridge_models import tiny_model

from qlens.bridge import ActivationCache, Bridge

TOKENS = torch.tensor([[5, 17, 301, 42, 9]])


@pytest.fixture(scope="module")
def gemma2_run() -> tuple[Bridge, torch.Tensor, ActivationCache]:
    bridge = Bridge(tiny_model("gemma2"))
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(TOKENS)
    return bridge, logits, cache


def test_full_names_and_shorthands(gemma2_run) -> None:  # noqa: ANN001
    _, _, cache = gemma2_run
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["resid_post", -1] is cache["blocks.1.hook_resid_post"]
    assert cache["q", 0] is cache["blocks.0.attn.hook_q"]
    assert cache["pre", 0] is cache["blocks.0.mlp.hook_pre"]
    assert cache["pre_linear", 0] is cache["blocks.0.mlp.hook_pre_linear"]
    assert cache["scale", 0, "ln2"] is cache["blocks.0.ln2.hook_scale"]
    assert cache["normalized"] is cache["ln_final.hook_normalized"]
    assert cache["embed"] is cache["hook_embed"]
    assert ("pattern", 1) in cache and "blocks.0.hook_resid_mid" in cache
    assert "blocks.0.attn.hook_result" not in cache and ("result", 0) not in cache
    assert list(cache.keys()) == [k for k, _ in cache.items()] == list(cache)
    with pytest.raises(KeyError, match="ambiguous.*blocks.0.ln1.hook_scale"):
        cache["scale", 0]


def test_missing_key_lists_what_is_present(gemma2_run) -> None:  # noqa: ANN001
    _, _, cache = gemma2_run
    with pytest.raises(KeyError, match=r"not in the cache.*blocks\.0\.hook_resid_pre") as info:
        cache["blocks.0.hook_resid_pr"]
    assert "Present: hook_embed" in str(info.value)
    with pytest.raises(KeyError, match="not in the cache"):
        cache["pattern", 7]


def test_stack_and_accumulated_resid(gemma2_run) -> None:  # noqa: ANN001
    bridge, logits, cache = gemma2_run
    stacked = cache.stack_activation("resid_post")
    assert torch.equal(stacked, torch.stack([cache["resid_post", 0], cache["resid_post", 1]]))
    resid, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"]
    assert torch.equal(resid[2], cache["resid_post", 1])
    resid, labels = cache.accumulated_resid(layer=1, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre"]
    assert torch.equal(resid[1], cache["resid_mid", 0])
    normed = cache.accumulated_resid(apply_ln=True)
    assert (normed[-1] - cache["ln_final.hook_out"]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="layer must be in"):
        cache.accumulated_resid(layer=3)


def test_remove_batch_dim_and_to() -> None:
    bridge = Bridge(tiny_model("llama"))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS, remove_batch_dim=True, device="cpu")
        _, batched = bridge.run_with_cache(TOKENS)
    assert cache["resid_pre", 0].shape == (5, 64)
    assert torch.equal(cache["pattern", 0], batched["pattern", 0][0])
    assert batched.remove_batch_dim() is batched and batched["resid_pre", 0].shape == (5, 64)
    assert cache.to("cpu") is cache
    with torch.no_grad():
        _, two = bridge.run_with_cache(torch.cat([TOKENS, TOKENS]))
    with pytest.raises(ValueError, match="batch size 2"):
        two.remove_batch_dim()
    with pytest.raises(ValueError, match="batch of one"):
        bridge.run_with_cache(torch.cat([TOKENS, TOKENS]), remove_batch_dim=True)
    _, plain = bridge.run_with_cache(TOKENS, names_filter="hook_embed", return_cache_object=False)
    assert isinstance(plain, dict) and list(plain) == ["hook_embed"]
    assert not plain["hook_embed"].requires_grad


def test_summary_reprs(gemma2_run) -> None:  # noqa: ANN001
    _, _, cache = gemma2_run
    text = repr(cache)
    assert text.startswith(f"ActivationCache({len(cache)} tensors")
    assert "blocks.1.attn.hook_pattern: (1, 4, 5, 5) float32" in text
    html = cache._repr_html_()
    assert "<table>" in html and "blocks.1.attn.hook_pattern" in html
    assert cache.total_bytes == sum(v.numel() * 4 for v in cache.values())
