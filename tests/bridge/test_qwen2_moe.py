"""Qwen2-MoE through the bridge: an MoE layer with a shared expert (layer 0) and a dense layer
(layer 1, ``mlp_only_layers``) give HF's own values at every hook, and edits act as they would
in HF."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from bridge_models import tiny_model
from module_hooks import recording, replacing
from torch import nn

from qlens.bridge import Bridge

TOKENS = torch.randint(3, 1000, (2, 7), generator=torch.Generator().manual_seed(3))
# hook_attn_scores / hook_pattern switch a layer to qlens' explicit attention (rounding differs
# from SDPA's); every other hook leaves the HF computation bit-identical.
SDPA_NAMES = lambda name: not name.endswith(("hook_attn_scores", "hook_pattern"))  # noqa: E731


def _hf_copy() -> nn.Module:
    # a copy: HF installs output-capturing hooks for output_hidden_states and keeps them
    return copy.deepcopy(tiny_model("qwen2_moe"))


def test_the_layers_are_an_moe_block_with_a_shared_expert_and_a_dense_mlp() -> None:
    model = tiny_model("qwen2_moe")
    assert type(model.model.layers[0].mlp).__name__ == "Qwen2MoeSparseMoeBlock"
    assert type(model.model.layers[1].mlp).__name__ == "Qwen2MoeMLP"
    names = Bridge(model).hook_names
    assert "blocks.0.mlp.hook_router_logits" in names and "blocks.0.mlp.hook_pre" not in names
    assert "blocks.1.mlp.hook_router_logits" not in names
    assert {
        "blocks.1.mlp.hook_pre",
        "blocks.1.mlp.hook_pre_linear",
        "blocks.1.mlp.hook_post",
    } < set(names)


def test_logits_and_residual_stream_equal_hf_exactly() -> None:
    model = _hf_copy()
    bridge = Bridge(model)
    with torch.no_grad():
        hf = model(TOKENS, output_hidden_states=True)
        assert torch.equal(bridge(TOKENS), hf.logits)
        logits, cache = bridge.run_with_cache(TOKENS, names_filter=SDPA_NAMES)
    assert torch.equal(logits, hf.logits)
    assert torch.equal(cache["blocks.0.hook_resid_pre"], hf.hidden_states[0])
    assert torch.equal(cache["blocks.0.hook_resid_post"], hf.hidden_states[1])
    assert torch.equal(cache["ln_final.hook_out"], hf.hidden_states[2])  # HF's last is normed


def test_hooks_carry_hf_values_and_mlp_out_includes_the_gated_shared_expert() -> None:
    model = _hf_copy()
    bridge = Bridge(model)
    paths = [
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.experts",
        "model.layers.0.mlp.shared_expert",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.1.mlp",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    with torch.no_grad(), recording(model, paths) as hf:
        _, cache = bridge.run_with_cache(TOKENS, names_filter=SDPA_NAMES)
    shape = (*TOKENS.shape, -1)
    assert torch.equal(cache["blocks.0.hook_attn_out"], hf["model.layers.0.self_attn"][0])
    router_logits, top_weights, top_indices = hf["model.layers.0.mlp.gate"]
    assert torch.equal(cache["blocks.0.mlp.hook_router_logits"], router_logits.reshape(shape))
    dense = torch.zeros_like(router_logits).scatter(-1, top_indices, top_weights)
    assert torch.equal(cache["blocks.0.mlp.hook_router_weights"], dense.reshape(shape))
    mlp_out = cache["blocks.0.hook_mlp_out"]
    assert torch.equal(mlp_out, hf["model.layers.0.mlp"])
    shared = torch.sigmoid(hf["model.layers.0.mlp.shared_expert_gate"])
    shared = shared * hf["model.layers.0.mlp.shared_expert"]
    assert shared.abs().max() > 1e-3  # the shared expert contributes
    assert torch.equal(mlp_out, (hf["model.layers.0.mlp.experts"] + shared).reshape(mlp_out.shape))
    assert torch.equal(cache["blocks.1.hook_mlp_out"], hf["model.layers.1.mlp"])
    assert torch.equal(cache["blocks.1.mlp.hook_pre"], hf["model.layers.1.mlp.gate_proj"])
    assert torch.equal(cache["blocks.1.mlp.hook_pre_linear"], hf["model.layers.1.mlp.up_proj"])


def _hf_patched_logits(path: str, edit: Callable[[Any], Any]) -> torch.Tensor:
    """HF's logits with the output of the module at ``path`` replaced by ``edit(output)``."""
    model = tiny_model("qwen2_moe")
    with torch.no_grad(), replacing(model, {path: edit}):
        return model(TOKENS).logits


def test_patching_mlp_out_acts_as_in_hf() -> None:
    bridge = Bridge(tiny_model("qwen2_moe"))
    for layer in (0, 1):
        with torch.no_grad():
            ours = bridge.run_with_hooks(
                TOKENS, fwd_hooks=[(f"blocks.{layer}.hook_mlp_out", lambda x, hook: 0.5 * x)]
            )
        theirs = _hf_patched_logits(f"model.layers.{layer}.mlp", lambda out: 0.5 * out)
        assert torch.equal(ours, theirs)
        assert not torch.equal(ours, bridge(TOKENS))


def test_router_logit_edits_reroute_as_hf_would() -> None:
    bridge = Bridge(tiny_model("qwen2_moe"))
    boost = torch.tensor([0.0, 0.0, 0.0, 100.0])

    def hf_router(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits = out[0] + boost  # HF's Qwen2MoeTopKRouter on the edited logits
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        weights, indices = torch.topk(probs, 2, dim=-1)
        return logits, weights.to(logits.dtype), indices

    with (
        torch.no_grad(),
        bridge.hooks(fwd_hooks=[("blocks.0.mlp.hook_router_logits", lambda x, hook: x + boost)]),
    ):
        ours, cache = bridge.run_with_cache(TOKENS, names_filter="blocks.0.mlp.hook_router_weights")
    assert torch.all(cache["router_weights", 0][..., 3] > 0)  # expert 3 now picked everywhere
    theirs = _hf_patched_logits("model.layers.0.mlp.gate", hf_router)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, bridge(TOKENS))


def test_decoder_sparse_step_makes_the_other_layers_dense() -> None:
    import transformers as T

    torch.manual_seed(0)
    config = T.Qwen2MoeConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, norm_topk_prob=True,
    )  # fmt: skip
    model = T.AutoModelForCausalLM.from_config(config).eval()
    bridge = Bridge(model)
    assert "blocks.0.mlp.hook_pre" in bridge.hook_names
    assert "blocks.1.mlp.hook_router_weights" in bridge.hook_names
    shared = [n for n in bridge.hook_names if "routed" in n or "shared" in n]
    assert shared == ["blocks.1.mlp.hook_routed_out", "blocks.1.mlp.hook_shared_expert_out"]
    tokens = TOKENS % 100
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens, names_filter=SDPA_NAMES)
        assert torch.equal(logits, model(tokens).logits)
    weights = cache["router_weights", 1]
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens.shape))  # norm_topk_prob
