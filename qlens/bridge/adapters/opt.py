"""OPT: learned positions (offset by 2 inside HF's embedding), LayerNorm, ReLU MLP on fc1/fc2."""

from typing import Any

from qlens.bridge.adapters.base import Adapter, LayerPaths


def _check_opt(config: Any) -> None:
    if not getattr(config, "do_layer_norm_before", True):
        raise NotImplementedError(
            "qlens supports pre-norm OPT models only (config.do_layer_norm_before=True); "
            "post-norm variants such as opt-350m are not supported"
        )
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        raise NotImplementedError(
            "qlens does not support OPT models with word_embed_proj_dim != hidden_size "
            "(projected embeddings, e.g. opt-350m)"
        )


OPT = Adapter(
    family="opt",
    embed="model.decoder.embed_tokens",
    pos_embed="model.decoder.embed_positions",
    layers="model.decoder.layers",
    ln_final="model.decoder.final_layer_norm",
    unembed="lm_head",
    layer=LayerPaths(
        ln1="self_attn_layer_norm",
        attn="self_attn",
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.out_proj",
        ln2="final_layer_norm",
        mlp_in="fc1",
        mlp_down="fc2",
    ),
    normalization_type="LN",
    positional_embedding_type="standard",
    gated_mlp=False,
    flattens_tokens=True,
    config_attrs={"d_mlp": "ffn_dim", "act_fn": "activation_function"},
    check_config=_check_opt,
)
