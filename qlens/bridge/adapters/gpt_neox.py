"""GPT-NeoX: LayerNorm, partial rotary, per-head fused qkv, attention and MLP in parallel."""

from qlens.bridge.adapters.base import Adapter, LayerPaths

GPT_NEOX = Adapter(
    family="gpt_neox",
    default_prepend_bos=False,
    embed="gpt_neox.embed_in",
    layers="gpt_neox.layers",
    ln_final="gpt_neox.final_layer_norm",
    unembed="lm_head",
    layer=LayerPaths(
        ln1="input_layernorm",
        attn="attention",
        qkv="attention.query_key_value",
        o="attention.dense",
        ln2="post_attention_layernorm",
        mlp="mlp",
        mlp_in="mlp.dense_h_to_4h",
        mlp_down="mlp.dense_4h_to_h",
    ),
    normalization_type="LN",
    positional_embedding_type="rotary",
    gated_mlp=False,
    parallel_attn_mlp="use_parallel_residual",
    qkv_layout="per_head_qkv",
)
