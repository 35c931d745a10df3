"""Adapter tables and BridgeConfig against the HF models they describe."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from bridge_models import MOE_ARCHS, tiny_model

from qlens.bridge import ADAPTERS, Bridge

_DENSE_MLP_FIELDS = {"mlp_gate", "mlp_up", "mlp_down", "mlp_in", "mlp_gate_up"}


def test_config_facts(arch: str) -> None:
    model = tiny_model(arch)
    cfg = Bridge(model).cfg
    gqa = arch not in ("gpt2", "gpt_neox", "opt")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head) == (2, 64, 4, 16)
    assert cfg.n_kv_heads == (2 if gqa else 4)
    assert cfg.d_mlp == (256 if arch == "gpt2" else 128)  # GPT-2: n_inner=None means 4*d_model
    assert cfg.d_vocab == model.get_output_embeddings().weight.shape[0] == 1000
    moe = arch in MOE_ARCHS
    assert (cfg.n_experts, cfg.experts_per_token) == ((4, 2) if moe else (0, 0))
    assert cfg.parallel_attn_mlp == (arch == "gpt_neox")
    assert cfg.positional_embedding_type == ("standard" if arch in ("gpt2", "opt") else "rotary")
    assert cfg.normalization_type == ("LN" if arch in ("gpt2", "gpt_neox", "opt") else "RMS")
    rotary = {"gpt2": None, "opt": None, "gpt_neox": 4}  # NeoX rotates 25% of each head
    assert cfg.rotary_dim == rotary.get(arch, 16)
    assert cfg.norm_weight_offset == (1.0 if arch.startswith("gemma") else 0.0)
    assert cfg.attention_sinks == (arch == "gpt_oss")
    assert cfg.attn_logit_softcapping == getattr(model.config, "attn_logit_softcapping", None)
    assert isinstance(cfg.act_fn, str) and isinstance(cfg.eps, float)


def test_every_adapter_path_exists(arch: str) -> None:
    model = tiny_model(arch)
    adapter = ADAPTERS[model.config.model_type]
    for path in (adapter.embed, adapter.pos_embed, adapter.ln_final, adapter.unembed):
        if path is not None:
            model.get_submodule(path)
    layer = model.get_submodule(adapter.layers)[0]
    moe = adapter.layer.router is not None
    for field, path in adapter.layer.__dict__.items():
        if path is None or (moe and field in _DENSE_MLP_FIELDS):
            continue
        layer.get_submodule(path)
    o_proj = layer.get_submodule(adapter.layer.o)
    in_features = o_proj.weight.shape[0] if adapter.conv1d else o_proj.weight.shape[1]
    assert in_features == model.config.num_attention_heads * Bridge(model).cfg.d_head


def test_unsupported_architecture_names_families_and_how_to_add() -> None:
    config = T.BloomConfig(vocab_size=100, hidden_size=32, n_layer=1, n_head=2)
    model = T.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="no adapter for model_type 'bloom'") as info:
        Bridge(model)
    for family in ("gpt2", "llama", "gpt_oss", "qwen3_moe"):
        assert family in str(info.value)
    assert "qlens.bridge.adapters" in str(info.value)


def test_unsupported_variant_is_rejected() -> None:
    config = T.OPTConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=64,
        do_layer_norm_before=False,
    )
    with pytest.raises(NotImplementedError, match="do_layer_norm_before"):
        Bridge(T.AutoModelForCausalLM.from_config(config))


def test_bridge_does_not_touch_parameters(arch: str) -> None:
    model = tiny_model(arch)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    bridge = Bridge(model)
    with torch.no_grad():
        bridge.run_with_cache(torch.tensor([[5, 6, 7]]))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_a_fused_qkv_needs_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused qkv's layout places hook_q/hook_k and the split inputs: an adapter without it,
    or without any q/k projection on a rotary model, is refused when the bridge is built."""
    import dataclasses

    phi3 = ADAPTERS["phi3"]
    monkeypatch.setitem(ADAPTERS, "phi3", dataclasses.replace(phi3, qkv_layout=None))
    with pytest.raises(ValueError, match="'phi3' names a fused qkv but no qkv_layout"):
        Bridge(tiny_model("phi3"))
    no_qkv = dataclasses.replace(phi3, layer=dataclasses.replace(phi3.layer, qkv=None))
    monkeypatch.setitem(ADAPTERS, "phi3", no_qkv)
    with pytest.raises(ValueError, match="names neither q/k projections nor a fused qkv"):
        Bridge(tiny_model("phi3"))
