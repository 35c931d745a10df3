"""The accessors reproduce the model's own activations on every supported family."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from arch_models import ARCHS, MOE_ARCHS, perturbed_model

import qlens
from qlens.bridge import Bridge
from qlens.modules.model_quantize import quantize
from qlens.weights import accessors as A

# Families whose hook_q/hook_k are the plain projections: before rotary and q/k norms, as in
# TransformerLens (OPT's attention function receives pre-scaled queries).
PLAIN_QK = [a for a in ARCHS if a != "opt"]
TOL = dict(atol=2e-5, rtol=1e-5)
_CACHES: dict[str, tuple[Bridge, object, torch.Tensor, torch.Tensor]] = {}


def run(arch: str):
    """(bridge over a perturbed tiny model, its cache, tokens, logits), computed once."""
    if arch not in _CACHES:
        bridge = Bridge(perturbed_model(arch))
        tokens = torch.randint(
            3, bridge.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            logits, cache = bridge.run_with_cache(tokens)
        _CACHES[arch] = (bridge, cache, tokens, logits)
    return _CACHES[arch]


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bpm,hmd->bphd", x, w) + b


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_weights_reproduce_v_and_attn_out(arch):
    bridge, cache, _, _ = run(arch)
    for layer in range(bridge.cfg.n_layers):
        x = cache[f"blocks.{layer}.ln1.hook_out"]
        v = _project(x, A.W_V(bridge, layer), A.b_V(bridge, layer))
        torch.testing.assert_close(v, cache[f"blocks.{layer}.attn.hook_v"], **TOL)
        z = cache[f"blocks.{layer}.attn.hook_z"]
        out = torch.einsum("bphd,hdm->bpm", z, A.W_O(bridge, layer)) + A.b_O(bridge, layer)
        torch.testing.assert_close(out, cache[f"blocks.{layer}.hook_attn_out"], **TOL)


@pytest.mark.parametrize("arch", PLAIN_QK)
def test_query_and_key_weights_reproduce_q_and_k(arch):
    bridge, cache, _, _ = run(arch)
    for layer in range(bridge.cfg.n_layers):
        x = cache[f"blocks.{layer}.ln1.hook_out"]
        q = _project(x, A.W_Q(bridge, layer), A.b_Q(bridge, layer))
        k = _project(x, A.W_K(bridge, layer), A.b_K(bridge, layer))
        torch.testing.assert_close(q, cache[f"blocks.{layer}.attn.hook_q"], **TOL)
        torch.testing.assert_close(k, cache[f"blocks.{layer}.attn.hook_k"], **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_accessors_stack_the_layers(arch):
    bridge, _, _, _ = run(arch)
    n = bridge.cfg.n_layers
    # Qwen2-MoE: an MoE layer with a shared expert has no expert stack (see the test below)
    mlp_reads = () if arch == "qwen2_moe" else (A.W_in, A.W_out)
    for read in (A.W_Q, A.W_O, A.b_V, *mlp_reads):
        assert torch.equal(read(bridge), torch.stack([read(bridge, i) for i in range(n)]))
    groups = bridge.cfg.n_heads // bridge.cfg.n_kv_heads
    repeated = A.W_K(bridge, 0, repeat_kv=True)
    assert repeated.shape[0] == bridge.cfg.n_heads
    assert torch.equal(repeated[::groups], A.W_K(bridge, 0))


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MOE_ARCHS])
def test_mlp_weights_reproduce_the_mlp(arch):
    bridge, cache, _, _ = run(arch)
    for layer in range(bridge.cfg.n_layers):
        x = cache[f"blocks.{layer}.ln2.hook_out"]
        pre = cache[f"blocks.{layer}.mlp.hook_pre"]
        if bridge.cfg.gated_mlp:
            torch.testing.assert_close(x @ A.W_gate(bridge, layer), pre, **TOL)
            linear = x @ A.W_in(bridge, layer) + A.b_in(bridge, layer)
            torch.testing.assert_close(linear, cache[f"blocks.{layer}.mlp.hook_pre_linear"], **TOL)
        else:
            torch.testing.assert_close(
                x @ A.W_in(bridge, layer) + A.b_in(bridge, layer), pre, **TOL
            )
            with pytest.raises(ValueError, match="has no gated MLP, so there is no W_gate"):
                A.W_gate(bridge, layer)
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        out = post @ A.W_out(bridge, layer) + A.b_out(bridge, layer)
        torch.testing.assert_close(out, cache[f"blocks.{layer}.hook_mlp_out"], **TOL)
        with pytest.raises(ValueError, match="dense MLP layer; expert= applies to MoE layers"):
            A.W_in(bridge, layer, expert=0)


def _expert_output(bridge: Bridge, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
    gate = x @ A.W_gate(bridge, layer, expert=expert)
    up = x @ A.W_in(bridge, layer, expert=expert) + A.b_in(bridge, layer, expert=expert)
    gate = gate + A.b_gate(bridge, layer, expert=expert)
    if bridge.cfg.family == "gpt_oss":  # clamped SwiGLU, as GPT-OSS defines it
        config = bridge.model.config
        gate, up = (
            gate.clamp(max=config.swiglu_limit),
            up.clamp(-config.swiglu_limit, config.swiglu_limit),
        )
        hidden = (up + 1) * gate * torch.sigmoid(gate * config.swiglu_alpha)
    else:
        hidden = F.silu(gate) * up
    return hidden @ A.W_out(bridge, layer, expert=expert) + A.b_out(bridge, layer, expert=expert)


def _shared_expert_output(bridge: Bridge, layer: int, x: torch.Tensor) -> torch.Tensor:
    hidden = F.silu(x @ A.W_gate(bridge, layer, expert="shared"))
    hidden = hidden * (x @ A.W_in(bridge, layer, expert="shared"))
    scale = torch.sigmoid(x @ A.W_shared_expert_gate(bridge, layer))[..., None]
    return scale * (hidden @ A.W_out(bridge, layer, expert="shared"))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_and_router_weights_reproduce_the_moe_block(arch):
    bridge, cache, _, _ = run(arch)
    for layer in range(bridge.cfg.n_layers):
        if A.layer_module(bridge, layer, "experts") is None:
            continue  # a dense layer of Qwen2-MoE (mlp_only_layers)
        x = cache[f"blocks.{layer}.ln2.hook_out"]
        logits = x @ A.W_router(bridge, layer) + A.b_router(bridge, layer)
        torch.testing.assert_close(logits, cache[f"blocks.{layer}.mlp.hook_router_logits"], **TOL)
        weights = cache[f"blocks.{layer}.mlp.hook_router_weights"]
        out = sum(
            weights[..., e, None] * _expert_output(bridge, layer, e, x)
            for e in range(bridge.cfg.n_experts)
        )
        if arch == "qwen2_moe":
            out = out + _shared_expert_output(bridge, layer, x)
        torch.testing.assert_close(out, cache[f"blocks.{layer}.hook_mlp_out"], **TOL)
        stack = A.experts(bridge, layer).split_gate_up()[1].transpose(-1, -2)
        assert torch.equal(stack[1], A.W_in(bridge, layer, expert=1))
        with pytest.raises(IndexError, match="out of range for a layer with"):
            A.W_out(bridge, layer, expert=bridge.cfg.n_experts)


@pytest.mark.parametrize("arch", ARCHS)
def test_embedding_and_unembedding(arch):
    bridge, cache, tokens, logits = run(arch)
    scale = getattr(bridge.embed, "embed_scale", 1.0)
    torch.testing.assert_close(cache["hook_embed"], A.W_E(bridge)[tokens] * scale, **TOL)
    if bridge.pos_embed is not None:
        positions = torch.arange(tokens.shape[1])
        torch.testing.assert_close(
            cache["hook_pos_embed"],
            A.W_pos(bridge)[positions].expand_as(cache["hook_pos_embed"]),
            **TOL,
        )
    else:
        with pytest.raises(ValueError, match="has no learned position embedding"):
            A.W_pos(bridge)
    unembedded = cache["ln_final.hook_out"] @ A.W_U(bridge) + A.b_U(bridge)
    cap = bridge.cfg.final_logit_softcapping
    if cap:
        unembedded = torch.tanh(unembedded / cap) * cap
    torch.testing.assert_close(unembedded, logits, **TOL)


def test_layer_out_of_range_is_refused():
    bridge, _, _, _ = run("llama")
    with pytest.raises(IndexError, match="layer 5 is out of range for a model with 2 layers"):
        A.W_Q(bridge, 5)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_quantized_experts_are_read_through_the_guard(arch):
    bridge = Bridge(perturbed_model(arch))
    quantized = quantize(bridge, "int8", group_size=32)
    module = quantized.model.model.layers[0].mlp.experts
    # a layer with a shared expert has no expert stack: read one expert at a time
    one = {"expert": 0} if arch == "qwen2_moe" else {}
    with pytest.raises(NotImplementedError, match="qlens cannot read the experts of layer 0"):
        A.W_in(quantized, 0, **one)
    weights = A.experts(quantized, 0, dequantize=True)
    assert torch.equal(weights.gate_up, qlens.dequantize(module.gate_up_payload))
    assert torch.equal(weights.down, qlens.dequantize(module.down_payload))
    for read in (A.W_gate, A.W_in, A.W_out, A.b_gate, A.b_out):  # same layout as the float model
        torch.testing.assert_close(
            read(quantized, 0, dequantize=True, **one), read(bridge, 0, **one), atol=2e-3, rtol=0
        )
    if arch == "qwen2_moe":  # the shared expert and its gate are quantized linear layers
        shared = quantized.model.model.layers[0].mlp.shared_expert
        with pytest.raises(NotImplementedError, match="cannot read W_out of the shared expert"):
            A.W_out(quantized, 0, expert="shared")
        with pytest.raises(NotImplementedError, match="cannot read the shared expert gate"):
            A.W_shared_expert_gate(quantized, 0)
        got = A.W_out(quantized, 0, expert="shared", dequantize=True)
        assert torch.equal(got, qlens.dequantize(shared.down_proj).T)
        torch.testing.assert_close(
            A.W_shared_expert_gate(quantized, 0, dequantize=True),
            A.W_shared_expert_gate(bridge, 0), atol=2e-3, rtol=0,
        )  # fmt: skip


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "gpt_neox"])
def test_fused_projections_of_quantized_models_split_like_float_ones(arch):
    bridge = Bridge(perturbed_model(arch))
    quantized = quantize(bridge, "int8", group_size=32)
    with pytest.raises(
        NotImplementedError, match=r"qlens cannot read W_K of layer 1 \(fused qkv\)"
    ):
        A.W_K(quantized, 1)
    for read in (A.W_Q, A.W_K, A.W_V, A.b_V, A.W_O, A.W_in, A.W_out):
        torch.testing.assert_close(
            read(quantized, dequantize=True), read(bridge), atol=2e-3, rtol=0
        )


def test_qwen2_moe_shared_expert_weights_are_the_hf_modules_and_stacks_refuse():
    bridge, _, _, _ = run("qwen2_moe")
    mlp = bridge.model.model.layers[0].mlp
    shared = mlp.shared_expert
    assert torch.equal(A.W_gate(bridge, 0, expert="shared"), shared.gate_proj.weight.T)
    assert torch.equal(A.W_in(bridge, 0, expert="shared"), shared.up_proj.weight.T)
    assert torch.equal(A.W_out(bridge, 0, expert="shared"), shared.down_proj.weight.T)
    assert torch.equal(A.b_out(bridge, 0, expert="shared"), torch.zeros(64))
    assert torch.equal(A.W_shared_expert_gate(bridge, 0), mlp.shared_expert_gate.weight[0])
    gate_up = mlp.experts.gate_up_proj
    assert torch.equal(A.W_gate(bridge, 0, expert=2), gate_up[2, :128].T)
    assert torch.equal(A.W_in(bridge, 0, expert=2), gate_up[2, 128:].T)
    assert torch.equal(A.W_out(bridge, 0, expert=2), mlp.experts.down_proj[2].T)
    dense = bridge.model.model.layers[1].mlp  # mlp_only_layers=[1]
    assert torch.equal(A.W_in(bridge, 1), dense.up_proj.weight.T)
    stack = r"layer 0 is a mixture-of-experts layer with a shared expert \(mlp\.shared_expert"
    for read in (A.W_in, A.W_gate, A.W_out, A.b_in, A.b_out):
        with pytest.raises(ValueError, match=stack):
            read(bridge, 0)
    with pytest.raises(ValueError, match=stack):
        bridge.W_out  # noqa: B018
    for expert in (0, "shared"):
        with pytest.raises(ValueError, match="layer 1 is a dense MLP layer; expert= applies"):
            A.W_in(bridge, 1, expert=expert)
    with pytest.raises(ValueError, match="layer 1 of this qwen2_moe model has no 'shared_exp"):
        A.W_shared_expert_gate(bridge, 1)


def test_shared_expert_gate_is_not_available_on_families_without_one():
    bridge, _, _, _ = run("qwen3_moe")
    with pytest.raises(ValueError, match="layer 0 of this qwen3_moe model has no shared expert"):
        A.W_out(bridge, 0, expert="shared")
