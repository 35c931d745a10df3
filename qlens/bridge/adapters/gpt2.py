"""GPT-2: learned positions, LayerNorm, Conv1D layers (weights stored [in, out]), fused qkv."""

from typing import Any

from qlens.bridge.adapters.base import Adapter, LayerPaths


def _gpt2_d_mlp(config: Any) -> int:
    n_inner = getattr(config, "n_inner", None)
    return int(n_inner) if n_inner is not None else 4 * int(config.hidden_size)


GPT2 = Adapter(
    family="gpt2",
    embed="transformer.wte",
    pos_embed="transformer.wpe",
    layers="transformer.h",
    ln_final="transformer.ln_f",
    unembed="lm_head",
    layer=LayerPaths(
        ln1="ln_1",
        attn="attn",
        qkv="attn.c_attn",
        o="attn.c_proj",
        ln2="ln_2",
        mlp="mlp",
        mlp_in="mlp.c_fc",
        mlp_down="mlp.c_proj",
    ),
    normalization_type="LN",
    positional_embedding_type="standard",
    gated_mlp=False,
    conv1d=True,
    qkv_layout="qkv_blocks",
    config_attrs={"d_mlp": _gpt2_d_mlp},
)
