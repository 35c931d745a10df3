"""Bridge forward equals the HF forward, and its activations mean what their names say."""

from __future__ import annotations

import copy

import pytest
import torch
from bridge_models import ARCHS, MOE_ARCHS, tiny_model
from transformers.pytorch_utils import Conv1D

from qlens.bridge import Bridge

TOL = 1e-5


def _tokens(batch: int = 2, pos: int = 7) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, pos), generator=torch.Generator().manual_seed(1))


def _saver(acts: dict[str, torch.Tensor]):  # noqa: ANN202
    def save(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        acts[hook.name] = x.detach()

    return save


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple]:
    """Per arch: (bridge, tokens, HF output with hidden states, every-hook activations, logits)."""
    out = {}
    for arch in ARCHS:
        model = tiny_model(arch)
        bridge = Bridge(model)
        bridge.set_use_hook_mlp_in(True)
        if any(n.endswith("attn.hook_q_input") for n in bridge.hook_names):
            bridge.set_use_split_qkv_input(True)  # hook_attn_in stays off: they exclude each other
        tokens = _tokens()
        acts: dict[str, torch.Tensor] = {}
        save = _saver(acts)
        with torch.no_grad():
            # on a copy: HF installs output-capturing forward hooks on the first
            # output_hidden_states call and never removes them
            hf = copy.deepcopy(model)(tokens, output_hidden_states=True)
            logits = bridge.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, save)])
        out[arch] = (bridge, tokens, hf, acts, logits)
    return out


def test_no_hooks_logits_equal_hf(arch: str) -> None:
    model = tiny_model(arch)
    tokens = _tokens()
    with torch.no_grad():
        expected = model(tokens).logits
        got = Bridge(model)(tokens)
    assert (got - expected).abs().max().item() <= TOL


def test_every_hook_fires_and_logits_equal_hf(arch: str, runs: dict) -> None:
    bridge, _, hf, acts, logits = runs[arch]
    assert set(acts) == {n for n in bridge.hook_names if not n.endswith("hook_attn_in")}
    assert (logits - hf.logits).abs().max().item() <= TOL


def test_residual_stream_matches_hf_hidden_states(arch: str, runs: dict) -> None:
    """HF's hidden_states[0] is the embedding, [i+1] the output of layer i, except the last entry,
    which HF returns after the final norm: it is compared with ln_final.hook_out."""
    bridge, _, hf, acts, _ = runs[arch]
    n = bridge.cfg.n_layers
    hs = hf.hidden_states
    assert (acts["blocks.0.hook_resid_pre"] - hs[0]).abs().max() <= TOL
    for i in range(n - 1):
        assert (acts[f"blocks.{i}.hook_resid_post"] - hs[i + 1]).abs().max() <= TOL
        assert torch.equal(
            acts[f"blocks.{i}.hook_resid_post"], acts[f"blocks.{i + 1}.hook_resid_pre"]
        )
    assert (acts["ln_final.hook_out"] - hs[n]).abs().max() <= TOL
    if "hook_pos_embed" in acts:
        embed_sum = acts["hook_embed"] + acts["hook_pos_embed"]
        assert (embed_sum - acts["blocks.0.hook_resid_pre"]).abs().max() <= TOL


def test_attention_shapes_and_patterns(arch: str, runs: dict) -> None:
    bridge, tokens, _, acts, _ = runs[arch]
    cfg, (batch, pos) = bridge.cfg, tokens.shape
    model = tiny_model(arch)
    for i in range(cfg.n_layers):
        a = f"blocks.{i}.attn."
        assert acts[a + "hook_q"].shape == (batch, pos, cfg.n_heads, cfg.d_head)
        assert acts[a + "hook_k"].shape == (batch, pos, cfg.n_kv_heads, cfg.d_head)
        assert acts[a + "hook_v"].shape == (batch, pos, cfg.n_kv_heads, cfg.d_head)
        assert acts[a + "hook_z"].shape == (batch, pos, cfg.n_heads, cfg.d_head)
        pattern = acts[a + "hook_pattern"]
        assert pattern.shape == (batch, cfg.n_heads, pos, pos)
        assert acts[a + "hook_attn_scores"].shape == pattern.shape
        future = torch.ones(pos, pos, dtype=torch.bool).triu(1)
        assert torch.all(pattern[..., future] == 0)
        row_sums = pattern.sum(-1)
        if cfg.attention_sinks:  # pattern excludes the sink: rows sum to 1 - p(sink)
            scores = acts[a + "hook_attn_scores"]
            sink = model.model.layers[i].self_attn.sinks.detach().view(1, -1, 1)
            p_sink = torch.exp(sink) / (torch.exp(sink) + torch.exp(scores).sum(-1))
            assert torch.allclose(row_sums + p_sink, torch.ones_like(row_sums), atol=TOL)
            assert p_sink.min() > 1e-3
        else:
            assert torch.allclose(row_sums, torch.ones_like(row_sums), atol=TOL)
        # z is the pattern-weighted sum of values (GQA: head h reads KV head h // group)
        group = cfg.n_heads // cfg.n_kv_heads
        v = acts[a + "hook_v"].repeat_interleave(group, dim=2)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        assert (z - acts[a + "hook_z"]).abs().max() <= TOL


def test_sliding_window_masks_old_keys() -> None:
    bridge, _, _, acts, _ = _run_single("mistral")
    window = bridge.cfg.sliding_window
    pattern = acts["blocks.0.attn.hook_pattern"]
    pos = pattern.shape[-1]
    too_old = torch.ones(pos, pos, dtype=torch.bool).tril(-window)
    assert too_old.any() and torch.all(pattern[..., too_old] == 0)
    assert torch.all(pattern[..., ~too_old & ~torch.ones(pos, pos, dtype=torch.bool).triu(1)] > 0)


def _run_single(arch: str) -> tuple:
    model = tiny_model(arch)
    bridge = Bridge(model)
    tokens = _tokens()
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens)
    return bridge, tokens, logits, dict(cache.items()), None


def _o_proj(bridge: Bridge, layer: int) -> torch.nn.Module:
    return bridge.model.get_submodule(bridge.adapter.layers)[layer].get_submodule(
        bridge.adapter.layer.o
    )


def test_z_times_per_head_w_o_reproduces_attn_out(arch: str, runs: dict) -> None:
    bridge, _, _, acts, _ = runs[arch]
    cfg = bridge.cfg
    for i in range(cfg.n_layers):
        o_proj = _o_proj(bridge, i)
        weight = o_proj.weight.detach()
        w_in_out = weight if isinstance(o_proj, Conv1D) else weight.T  # [n_heads*d_head, d_model]
        w_o = w_in_out.reshape(cfg.n_heads, cfg.d_head, cfg.d_model)
        z = acts[f"blocks.{i}.attn.hook_z"]
        per_head = torch.einsum("bphd,hdm->bphm", z, w_o)
        bias = o_proj.bias.detach() if o_proj.bias is not None else 0.0
        attn_out = acts[f"blocks.{i}.hook_attn_out"]
        assert (per_head.sum(2) + bias - attn_out).abs().max() <= TOL
        result = acts[f"blocks.{i}.attn.hook_result"]
        assert result.shape == (*z.shape[:2], cfg.n_heads, cfg.d_model)
        assert (result - per_head).abs().max() <= TOL
        assert (result.sum(2) + bias - attn_out).abs().max() <= TOL


def test_residual_decomposes_into_branches(arch: str, runs: dict) -> None:
    """resid_post = resid_pre + attention branch + MLP branch (post-norm outputs in sandwich
    families); resid_mid sits between them for sequential blocks."""
    bridge, _, _, acts, _ = runs[arch]
    for i in range(bridge.cfg.n_layers):
        p = f"blocks.{i}."
        attn = acts.get(p + "ln1_post.hook_out", acts[p + "hook_attn_out"])
        mlp = acts.get(p + "ln2_post.hook_out", acts[p + "hook_mlp_out"])
        total = acts[p + "hook_resid_pre"] + attn + mlp
        assert (total - acts[p + "hook_resid_post"]).abs().max() <= TOL
        if not bridge.cfg.parallel_attn_mlp:
            mid = acts[p + "hook_resid_mid"]
            assert (acts[p + "hook_resid_pre"] + attn - mid).abs().max() <= TOL
        else:
            assert p + "hook_resid_mid" not in bridge.hook_names


def test_norm_scale_and_normalized(arch: str, runs: dict) -> None:
    bridge, _, _, acts, _ = runs[arch]
    x = acts["blocks.0.hook_resid_pre"]
    if bridge.cfg.normalization_type == "LN":
        expected = (x.var(-1, unbiased=False, keepdim=True) + bridge.cfg.eps).sqrt()
    else:
        expected = (x.pow(2).mean(-1, keepdim=True) + bridge.cfg.eps).sqrt()
    assert (acts["blocks.0.ln1.hook_scale"] - expected).abs().max() <= TOL
    ln1 = bridge.model.get_submodule(bridge.adapter.layers)[0].get_submodule(
        bridge.adapter.layer.ln1
    )
    with torch.no_grad():
        assert (acts["blocks.0.ln1.hook_out"] - ln1(x)).abs().max() <= TOL


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MOE_ARCHS])
def test_mlp_hooks_compose_to_mlp_out(arch: str, runs: dict) -> None:
    """post = act(pre) [* pre_linear when gated]; down_proj(post) = mlp_out (dense layers)."""
    from transformers.activations import ACT2FN

    bridge, _, _, acts, _ = runs[arch]
    act = ACT2FN[bridge.cfg.act_fn]
    down = bridge.model.get_submodule(bridge.adapter.layers)[0].get_submodule(
        bridge.adapter.layer.mlp_down
    )
    pre = acts["blocks.0.mlp.hook_pre"]
    expected = act(pre)
    if bridge.cfg.gated_mlp:
        expected = expected * acts["blocks.0.mlp.hook_pre_linear"]
    assert pre.shape == (2, 7, bridge.cfg.d_mlp)
    assert (acts["blocks.0.mlp.hook_post"] - expected).abs().max() <= TOL
    with torch.no_grad():
        out = down(acts["blocks.0.mlp.hook_post"])
    assert (out - acts["blocks.0.hook_mlp_out"]).abs().max() <= TOL
