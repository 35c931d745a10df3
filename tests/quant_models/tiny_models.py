"""Random-init tiny causal LMs whose linear shapes suit every scheme (dims multiples of 128)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB = 96
HIDDEN = 128
INTERMEDIATE = 256

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=64)
_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON, **_ATTENTION, intermediate_size=INTERMEDIATE, num_hidden_layers=2
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **_COMMON, **_ATTENTION, intermediate_size=INTERMEDIATE, num_hidden_layers=1
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_inner=INTERMEDIATE,
        n_layer=1,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON,
        **_ATTENTION,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        **_ATTENTION,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(  # an MoE layer, then a dense one
        **_COMMON,
        **_ATTENTION,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **_COMMON,
        **_ATTENTION,
        intermediate_size=128,
        num_hidden_layers=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def make_model(family: str, seed: int = 0) -> nn.Module:
    """A random tiny ``family`` causal LM in fp32 eval mode; biases and router weights randomized."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Some families initialise biases / routers / sinks to zero; randomize everything so
            # a wrong bias or routing path cannot hide.
            if param.ndim == 1 and "norm" not in name and "ln" not in name:
                param.normal_(0.0, 0.05)
            if "router" in name or name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def input_ids(seq: int = 7, batch: int = 2, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=generator)
