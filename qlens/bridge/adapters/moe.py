"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS (fused 3-D experts in
memory).

Dense layers inside an MoE model (Qwen2/3-MoE ``mlp_only_layers``) use the Llama MLP paths.
Qwen2-MoE adds a shared expert to each MoE block (see ``LayerPaths.shared_mlp_gate``).
"""

from qlens.bridge.adapters.base import Adapter, LayerPaths
from qlens.bridge.adapters.llama import LLAMA, LLAMA_LAYER

_MOE_LAYER = {**LLAMA_LAYER.__dict__, "router": "mlp.gate", "experts": "mlp.experts"}

MIXTRAL = Adapter(
    **{
        **LLAMA.__dict__,
        "family": "mixtral",
        "layer": LayerPaths(**_MOE_LAYER),
        "experts_gate_up_layout": "halves",
        "router_scheme": "softmax_topk",
        "config_attrs": {"n_experts": "num_local_experts"},
    }
)
QWEN3_MOE = Adapter(
    **{
        **MIXTRAL.__dict__,
        "family": "qwen3_moe",
        "default_prepend_bos": False,
        "layer": LayerPaths(
            **{**_MOE_LAYER, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        ),
        "router_renormalize": "norm_topk_prob",
        "config_attrs": {"n_experts": "num_experts", "d_mlp": "moe_intermediate_size"},
    }
)
QWEN2_MOE = Adapter(
    **{
        **QWEN3_MOE.__dict__,
        "family": "qwen2_moe",
        "layer": LayerPaths(
            **{
                **_MOE_LAYER,
                "shared_mlp_gate": "mlp.shared_expert.gate_proj",
                "shared_mlp_up": "mlp.shared_expert.up_proj",
                "shared_mlp_down": "mlp.shared_expert.down_proj",
                "shared_expert_gate": "mlp.shared_expert_gate",
            }
        ),
    }
)
GPT_OSS = Adapter(
    **{
        **MIXTRAL.__dict__,
        "family": "gpt_oss",
        "layer": LayerPaths(**{**_MOE_LAYER, "router": "mlp.router"}),
        "experts_gate_up_layout": "interleaved",
        "experts_weights_in_out": True,
        "router_scheme": "topk_softmax",
        "act_fn": "swiglu_oss",
    }
)
