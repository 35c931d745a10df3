"""Llama-style families: pre-norm RMSNorm, rotary, gated MLP, separate q/k/v projections."""

from qlens.bridge.adapters.base import Adapter, LayerPaths

LLAMA_LAYER = LayerPaths(
    ln1="input_layernorm",
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.o_proj",
    ln2="post_attention_layernorm",
    mlp="mlp",
    mlp_gate="mlp.gate_proj",
    mlp_up="mlp.up_proj",
    mlp_down="mlp.down_proj",
)

LLAMA = Adapter(
    family="llama",
    embed="model.embed_tokens",
    layers="model.layers",
    ln_final="model.norm",
    unembed="lm_head",
    layer=LLAMA_LAYER,
    normalization_type="RMS",
    positional_embedding_type="rotary",
)
MISTRAL = Adapter(**{**LLAMA.__dict__, "family": "mistral"})
QWEN2 = Adapter(**{**LLAMA.__dict__, "family": "qwen2", "default_prepend_bos": False})
QWEN3 = Adapter(
    **{
        **LLAMA.__dict__,
        "family": "qwen3",
        "default_prepend_bos": False,
        "layer": LayerPaths(
            **{**LLAMA_LAYER.__dict__, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        ),
    }
)
