"""Gemma families: RMSNorm with (1 + weight), scaled embeddings, gated GELU MLP.

Gemma 2 and Gemma 3 add sandwich norms around attention and MLP (``ln1_post``, ``ln2_post``);
Gemma 2 also soft-caps attention logits, Gemma 3 normalizes q and k.
"""

from qlens.bridge.adapters.base import Adapter, LayerPaths
from qlens.bridge.adapters.llama import LLAMA, LLAMA_LAYER

GEMMA = Adapter(**{**LLAMA.__dict__, "family": "gemma", "norm_weight_offset": 1.0})

GEMMA2_LAYER = LayerPaths(
    **{
        **LLAMA_LAYER.__dict__,
        "ln1_post": "post_attention_layernorm",
        "ln2": "pre_feedforward_layernorm",
        "ln2_post": "post_feedforward_layernorm",
    }
)
GEMMA2 = Adapter(**{**GEMMA.__dict__, "family": "gemma2", "layer": GEMMA2_LAYER})
GEMMA3_TEXT = Adapter(
    **{
        **GEMMA.__dict__,
        "family": "gemma3_text",
        "layer": LayerPaths(
            **{**GEMMA2_LAYER.__dict__, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        ),
    }
)
