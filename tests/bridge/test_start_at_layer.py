"""``forward(start_at_layer=k)``: the layers from ``k`` on, run on a residual stream, as
TransformerLens runs them; the earlier layers are skipped, and hooks there are refused."""

from __future__ import annotations

import pytest
import torch
from bridge_models import tiny_model

from qlens import Bridge

TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 4, 5, 6], [1, 6, 6, 7, 8, 5, 4, 5, 6]])
FAMILIES = ["llama", "gpt2", "gemma2", "gpt_neox", "qwen3_moe", "gpt_oss", "opt"]


def _resid_pre(bridge: Bridge, **kwargs) -> dict[int, torch.Tensor]:
    """The residual before each layer and before the final norm, of a forward on TOKENS."""
    n = bridge.cfg.n_layers
    names = [f"blocks.{k}.hook_resid_pre" for k in range(n)] + [f"blocks.{n - 1}.hook_resid_post"]
    _, cache = bridge.run_with_cache(TOKENS, names_filter=names, **kwargs)
    return {k: cache[name] for k, name in enumerate(names)}


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_later_layers_on_a_residual_give_the_whole_forwards_logits(arch: str) -> None:
    """From every layer (and from the final norm), the logits of the whole forward, bit for
    bit; with ``stop_at_layer`` the residual there; with a padding mask, the masked forward's;
    the skipped layers get their own forward back."""
    bridge = Bridge(tiny_model(arch))
    n = bridge.cfg.n_layers
    with torch.no_grad():
        logits = bridge(TOKENS)
        resid = _resid_pre(bridge)
        for k in range(n + 1):
            assert torch.equal(bridge(resid[k], start_at_layer=k), logits), k
        assert torch.equal(bridge(resid[n - 1], start_at_layer=-1), logits)
        assert torch.equal(bridge(resid[0], start_at_layer=0, stop_at_layer=n - 1), resid[n - 1])
        assert bridge(resid[1], start_at_layer=1, return_type=None) is None
        mask = torch.ones_like(TOKENS)
        mask[1, :3] = 0
        masked = bridge(TOKENS, attention_mask=mask)
        resid_masked = _resid_pre(bridge, attention_mask=mask)
        out = bridge(resid_masked[1], start_at_layer=1, attention_mask=mask)
        assert torch.equal(out, masked)
    assert not any("forward" in layer.__dict__ for layer in bridge.model.modules())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_cache_from_a_later_layer_holds_what_the_whole_forward_cached(arch: str) -> None:
    bridge = Bridge(tiny_model(arch))
    with torch.no_grad():
        _, whole = bridge.run_with_cache(TOKENS)
        _, later = bridge.run_with_cache(whole["resid_pre", 1], start_at_layer=1)
    assert later.keys() and all(not k.startswith(("blocks.0.", "hook_")) for k in later.keys())
    assert {k for k in whole.keys() if k.startswith(("blocks.1.", "ln_final."))} == set(
        later.keys()
    )
    for key in later.keys():
        assert torch.equal(later[key], whole[key]), key


def test_start_at_layer_refuses_what_it_cannot_run() -> None:
    bridge = Bridge(tiny_model("llama"))
    resid = _resid_pre(bridge)[1]
    with pytest.raises(ValueError, match=r"'blocks.0.hook_resid_post' cannot fire with start_"):
        bridge.run_with_hooks(
            resid, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x)], start_at_layer=1
        )
    with pytest.raises(ValueError, match=r"'hook_embed' cannot fire with start_at_layer=1"):
        bridge.run_with_cache(resid, names_filter=["hook_embed"], start_at_layer=1)
    with pytest.raises(TypeError, match=r"residual stream \[batch pos d_model\].*int64"):
        bridge(TOKENS, start_at_layer=1)
    with pytest.raises(ValueError, match=r"\[batch pos d_model=\d+\], got \(2, 9, 3\)"):
        bridge(resid[..., :3], start_at_layer=1)
    with pytest.raises(ValueError, match="no tokens to score"):
        bridge(resid, start_at_layer=1, return_type="loss")
    with pytest.raises(ValueError, match=r"stop_at_layer \(1\) must come after start_at_layer"):
        bridge(resid, start_at_layer=1, stop_at_layer=1)
    with pytest.raises(ValueError, match=r"start_at_layer must be in \[-2, 2\], got 3"):
        bridge(resid, start_at_layer=3)
    assert not any("forward" in layer.__dict__ for layer in bridge.model.modules())
    assert not any(p.is_active for p in bridge.hook_dict.values())
    with torch.no_grad():  # a hook from the start layer on fires on the given residual
        seen = []
        bridge.run_with_hooks(
            resid,
            fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: seen.append(x.clone()))],
            start_at_layer=1,
        )
    assert torch.equal(seen[0], resid)
