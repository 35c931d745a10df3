"""MoE router hooks, and the guarded per-head result on unreadable (quantized) weights."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from bridge_models import MOE_ARCHS, tiny_model

from qlens.bridge import Bridge

TOKENS = torch.tensor([[5, 17, 301, 42, 9, 77]])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_hooks(arch: str) -> None:
    bridge = Bridge(tiny_model(arch))
    k, n_experts = bridge.cfg.experts_per_token, bridge.cfg.n_experts
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS)
        clean = bridge(TOKENS)
        # re-running the family's routing on unchanged logits reproduces the forward exactly
        same = bridge.run_with_hooks(
            TOKENS, fwd_hooks=[("blocks.0.mlp.hook_router_logits", lambda x, hook: x.clone())]
        )
    assert torch.equal(same, clean)
    logits, weights = cache["router_logits", 0], cache["router_weights", 0]
    assert logits.shape == weights.shape == (1, 6, n_experts)
    assert torch.all((weights > 0).sum(-1) == k)
    top = logits.topk(k, dim=-1).indices
    assert torch.all(weights.gather(-1, top) > 0)  # the selected experts are the top-k logits
    if arch not in ("qwen2_moe", "qwen3_moe") or bridge.model.config.norm_topk_prob:
        assert torch.allclose(weights.sum(-1), torch.ones(1, 6), atol=1e-6)


def test_router_edits_change_routing_and_mixing() -> None:
    bridge = Bridge(tiny_model("mixtral"))

    def force_expert_3(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
        return x + torch.tensor([0.0, 0.0, 0.0, 100.0])

    with torch.no_grad():
        clean = bridge(TOKENS)
        with bridge.hooks(fwd_hooks=[("blocks.0.mlp.hook_router_logits", force_expert_3)]):
            forced, cache = bridge.run_with_cache(TOKENS, names_filter=lambda n: "router" in n)
    assert torch.all(cache["router_weights", 0][..., 3] > 0)
    assert not torch.allclose(forced, clean)

    def move_weight_to_unselected(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
        return torch.full_like(x, 0.25)

    with pytest.raises(ValueError, match="did not select.*hook_router_logits"):
        bridge.run_with_hooks(
            TOKENS, fwd_hooks=[("blocks.0.mlp.hook_router_weights", move_weight_to_unselected)]
        )


class _Int8Linear(torch.nn.Module):
    """A weight stored as int8 with a per-row scale, as a quantized layer would hold it."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.scale = w.abs().amax(1, keepdim=True) / 127
        self.weight = torch.nn.Parameter(
            (w / self.scale).round().to(torch.int8), requires_grad=False
        )
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.float() * self.scale)


def test_hook_result_refuses_unreadable_weights() -> None:
    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    model = T.AutoModelForCausalLM.from_config(config).eval()
    attn = model.model.layers[0].self_attn
    attn.o_proj = _Int8Linear(attn.o_proj)
    bridge = Bridge(model)
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens)  # everything else still works
        assert "blocks.0.attn.hook_z" in cache
        with pytest.raises(
            NotImplementedError, match=r"compute per-head attention results \(hook_result\)"
        ):
            bridge.run_with_cache(tokens, names_filter="blocks.0.attn.hook_result")
    assert all(not m._forward_hooks for m in model.modules())


def test_result_edit_replaces_attention_output() -> None:
    bridge = Bridge(tiny_model("gpt2"))
    with torch.no_grad():
        clean = bridge(TOKENS)
        same = bridge.run_with_hooks(
            TOKENS, fwd_hooks=[("blocks.0.attn.hook_result", lambda x, hook: x.clone())]
        )
        # zero every head: attention output becomes the o_proj bias alone
        zero = lambda x, hook: torch.zeros_like(x)  # noqa: E731
        with bridge.hooks(fwd_hooks=[("blocks.0.attn.hook_result", zero)]):
            _, cache = bridge.run_with_cache(TOKENS, names_filter="blocks.0.hook_attn_out")
    assert (same - clean).abs().max() <= 1e-5
    bias = bridge.model.transformer.h[0].attn.c_proj.bias
    assert torch.equal(cache["attn_out", 0], bias.expand_as(cache["attn_out", 0]))


def test_idle_bridge_attaches_nothing() -> None:
    model = tiny_model("llama")
    bridge = Bridge(model)
    counts = []

    def count_hooks(_m, _args, _out) -> None:  # noqa: ANN001
        counts.append(
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        )

    handle = model.lm_head.register_forward_hook(count_hooks)
    try:
        with torch.no_grad():
            bridge(TOKENS)
            bridge.run_with_cache(TOKENS, names_filter="blocks.1.hook_resid_post")
    finally:
        handle.remove()
    assert counts[0] == 1  # only the counter itself: no bridge hooks without active names
    assert counts[1] == 2  # + the resid_post tap of block 1


def test_bridge_on_a_bitsandbytes_4bit_model(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("bitsandbytes")
    tiny_model("llama").save_pretrained(tmp_path)
    config = T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = T.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, device_map="cpu"
    )
    bridge = Bridge(model)
    with torch.no_grad():
        expected = model(TOKENS).logits
        logits, cache = bridge.run_with_cache(TOKENS)
        assert (logits - expected).abs().max() <= 1e-5
        assert "blocks.1.attn.hook_pattern" in cache
        with pytest.raises(NotImplementedError, match=r"attention results \(hook_result\)"):
            bridge.run_with_cache(TOKENS, names_filter="blocks.1.attn.hook_result")


def test_moe_model_with_dense_layers_gets_per_layer_names() -> None:
    torch.manual_seed(0)
    config = T.Qwen3MoeConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )
    model = T.AutoModelForCausalLM.from_config(config).eval()
    bridge = Bridge(model)
    assert "blocks.0.mlp.hook_router_logits" in bridge.hook_names
    assert "blocks.0.mlp.hook_pre" not in bridge.hook_names
    assert "blocks.1.mlp.hook_router_logits" not in bridge.hook_names
    assert {"blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_pre_linear"} <= set(bridge.hook_names)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens)
        assert (logits - model(tokens).logits).abs().max() <= 1e-5
    mlp = model.model.layers[1].mlp
    post = cache["post", 1]
    assert (mlp.down_proj(post) - cache["mlp_out", 1]).abs().max() <= 1e-5
