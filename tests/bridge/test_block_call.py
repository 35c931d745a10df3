"""``bridge.blocks[i](resid_pre)`` runs one block on a residual stream, as TransformerLens'
blocks do, and ``bridge.blocks[i].mlp(x)`` / ``.ln2(x)`` run their HF modules."""

from __future__ import annotations

import pytest
import torch
from bridge_models import tiny_model

import qlens
from qlens import Bridge

TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 4, 5, 6], [1, 6, 6, 7, 8, 5, 4, 5, 6]])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "gpt_neox", "qwen3_moe", "opt"])
def test_a_block_on_its_residual_gives_the_forwards_resid_post(arch: str) -> None:
    """Every block on the cached ``resid_pre`` gives the cached ``resid_post`` bit for bit,
    with and without a padding mask; negative indices count from the end. (The residual
    names only: caching the attention pattern takes another attention kernel, equal to
    float rounding, not bit for bit.)"""
    bridge = Bridge(tiny_model(arch))
    mask = torch.ones_like(TOKENS)
    mask[1, :3] = 0
    with torch.no_grad():
        for attention_mask in (None, mask):
            _, cache = bridge.run_with_cache(
                TOKENS, attention_mask=attention_mask, names_filter=lambda name: "resid" in name
            )
            for i, block in enumerate(bridge.blocks):
                out = block(cache["resid_pre", i], attention_mask=attention_mask)
                assert torch.equal(out, cache["resid_post", i]), (arch, i, attention_mask)
            last = bridge.run_block(-1, cache["resid_pre", bridge.cfg.n_layers - 1], attention_mask)
            assert torch.equal(last, cache["resid_post", bridge.cfg.n_layers - 1])


def test_a_blocks_hooks_fire_when_it_runs_and_others_are_refused() -> None:
    bridge = Bridge(tiny_model("llama"))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(
            TOKENS, names_filter=lambda name: "resid" in name or name.endswith("hook_pattern")
        )  # the pattern taken, as the hook below takes it
        resid = cache["resid_pre", 1]
        seen: list[str] = []
        bridge.add_hook("blocks.1.attn.hook_pattern", lambda x, hook: seen.append(hook.name))

        def zero_mlp(x: torch.Tensor, hook: object) -> torch.Tensor:
            return torch.zeros_like(x)

        with bridge.hooks(fwd_hooks=[("blocks.1.hook_mlp_out", zero_mlp)]):
            out = bridge.blocks[1](resid)
        assert seen == ["blocks.1.attn.hook_pattern"]
        assert torch.equal(out, cache["resid_mid", 1])  # the MLP's output patched to zero
        bridge.add_hook("blocks.0.hook_resid_post", lambda x, hook: x)
        with pytest.raises(ValueError, match=r"blocks\[1\] runs alone.*blocks\.0\.hook_resid_post"):
            bridge.blocks[1](resid)
        bridge.reset_hooks()
        with pytest.raises(ValueError, match=r"layer must be in \[-2, 1\], got 2"):
            bridge.run_block(2, resid)
    assert not any(p.is_active for p in bridge.hook_dict.values())


def test_an_mlp_and_a_norm_run_their_hf_modules() -> None:
    """``blocks[i].ln2`` on ``resid_mid`` then ``blocks[i].mlp`` give the cached
    ``mlp_out``; attention is refused with what to run instead, and so is a component whose
    hooks could not fire."""
    bridge = Bridge(tiny_model("llama"))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS)
        block = bridge.blocks[0]
        normalized = block.ln2(cache["resid_mid", 0])
        assert torch.equal(normalized, cache["blocks.0.ln2.hook_normalized"])
        assert torch.equal(block.mlp(normalized), cache["mlp_out", 0])
        with pytest.raises(TypeError, match=r"blocks\.0\.attn cannot run on its own.*blocks\[0\]"):
            block.attn(cache["resid_pre", 0])
        bridge.add_hook("blocks.0.mlp.hook_post", lambda x, hook: x)
        with pytest.raises(RuntimeError, match=r"blocks\.0\.mlp's hooks \(hook_post\) fire only"):
            block.mlp(normalized)


def test_a_quantized_block_runs_on_its_residual() -> None:
    """A block whose linears are quantized (int4, the CPU reference path) gives the quantized
    forward's ``resid_post`` bit for bit."""
    bridge = qlens.quantize(Bridge(tiny_model("llama")), "int4", group_size=32)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS, names_filter=lambda name: "resid" in name)
        for i, block in enumerate(bridge.blocks):
            assert torch.equal(block(cache["resid_pre", i]), cache["resid_post", i]), i
