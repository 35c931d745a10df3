"""Phi-3: Llama-like with a fused qkv projection and a fused gate/up projection."""

from qlens.bridge.adapters.base import Adapter, LayerPaths

PHI3 = Adapter(
    family="phi3",
    embed="model.embed_tokens",
    layers="model.layers",
    ln_final="model.norm",
    unembed="lm_head",
    layer=LayerPaths(
        ln1="input_layernorm",
        attn="self_attn",
        qkv="self_attn.qkv_proj",
        o="self_attn.o_proj",
        ln2="post_attention_layernorm",
        mlp="mlp",
        mlp_gate_up="mlp.gate_up_proj",
        mlp_down="mlp.down_proj",
    ),
    normalization_type="RMS",
    positional_embedding_type="rotary",
    qkv_layout="qkv_blocks",
    gate_up_layout="halves",
)
