"""Tiny random Qwen3-MoE / Qwen2-MoE models written as GGUF files by gguf-py, with the experts
stacked as llama.cpp's converter writes them (``blk.N.ffn_{gate,up,down}_exps``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf_files import add_stacked_experts, encode_weight, gguf_writer, write_out
from transformers import (
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

MOE_ARCHS = ("qwen3moe", "qwen2moe")
NUM_EXPERTS, TOP_K, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS = 4, 2, 256, 2, 4, 2
# transformers' GGUF config reader does not read the expert widths of these architectures
# (expert_feed_forward_length...), so the files use the config classes' defaults.
MOE_INTERMEDIATE = {"qwen3moe": 768, "qwen2moe": 1408}
SHARED_INTERMEDIATE = 5632  # Qwen2MoeConfig's default

# llama.cpp's Q4_K_M-like mix for the "mixed" files: Q4_K, with the experts' down in Q6_K.
MIXED = {"ffn_down_exps": "Q6_K", "attn_v": "Q6_K", "output": "Q8_0"}

_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}


def moe_type_of(kind: str) -> Callable[[str], str]:
    """``type_of`` for ``write_gguf_moe``: one GGML type everywhere, or ``"mixed"`` (``MIXED``)."""
    if kind == "mixed":
        return lambda name: MIXED.get(name.split(".")[-2], "Q4_K")
    return lambda _: kind


def make_gguf_moe(
    arch: str, seed: int = 0, expert_width: int | None = None, shared_width: int | None = None
) -> PreTrainedModel:
    """A random MoE of ``arch`` (GGUF name) with the sizes its GGUF file can describe
    (``expert_width`` / ``shared_width``: experts or a Qwen2-MoE shared expert of another width,
    which transformers' GGUF config reader ignores)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=expert_width or MOE_INTERMEDIATE[arch],
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if arch == "qwen3moe":
        config = Qwen3MoeConfig(**common, head_dim=HIDDEN // N_HEADS, norm_topk_prob=True)
        return Qwen3MoeForCausalLM(config).eval()
    config = Qwen2MoeConfig(
        **common, shared_expert_intermediate_size=shared_width or SHARED_INTERMEDIATE
    )
    return Qwen2MoeForCausalLM(config).eval()


def write_gguf_moe(
    model: PreTrainedModel,
    path: Path,
    arch: str,
    type_of: Callable[[str], str],
    *,
    experts_written: int | None = None,
    omit: tuple[str, ...] = (),
) -> Path:
    """Write ``model`` to ``path`` as a GGUF ``arch`` file; ``type_of(gguf_tensor_name)`` names
    each linear's GGML type. Broken files: ``experts_written`` keeps only that many experts,
    ``omit`` leaves out the tensors of those GGUF names."""
    config = model.config
    writer = gguf_writer(path, arch, config)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    else:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    def add(name: str, tensor: torch.Tensor | np.ndarray, type_name: str, seed: int = 0) -> None:
        values = tensor if isinstance(tensor, np.ndarray) else tensor.detach().float().numpy()
        data, qtype = encode_weight(name, values, type_name, seed)
        writer.add_tensor(name, data, raw_dtype=qtype)

    def linear(name: str, weight: torch.Tensor, seed: int) -> None:
        add(name, weight, type_of(name), seed)

    add("token_embd.weight", model.model.embed_tokens.weight, "F32")
    for index, layer in enumerate(model.model.layers):
        blk = f"blk.{index}"
        add(f"{blk}.attn_norm.weight", layer.input_layernorm.weight, "F32")
        add(f"{blk}.ffn_norm.weight", layer.post_attention_layernorm.weight, "F32")
        for seed, (hf_name, gguf_name) in enumerate(_ATTENTION.items()):
            projection = layer.self_attn.get_submodule(hf_name)
            linear(f"{blk}.{gguf_name}.weight", projection.weight, 100 * index + seed)
            if projection.bias is not None:
                add(f"{blk}.{gguf_name}.bias", projection.bias, "F32")
        if arch == "qwen3moe":
            add(f"{blk}.attn_q_norm.weight", layer.self_attn.q_norm.weight, "F32")
            add(f"{blk}.attn_k_norm.weight", layer.self_attn.k_norm.weight, "F32")
        mlp = layer.mlp
        add(f"{blk}.ffn_gate_inp.weight", mlp.gate.weight, "F32")
        add_stacked_experts(
            writer, index, mlp.experts, type_of, experts_written=experts_written, omit=omit
        )
        if arch == "qwen2moe":
            for seed, (hf_name, gguf_name) in enumerate(_SHARED.items()):
                weight = mlp.shared_expert.get_submodule(hf_name).weight
                linear(f"{blk}.{gguf_name}.weight", weight, 200 * index + seed)
            add(f"{blk}.ffn_gate_inp_shexp.weight", mlp.shared_expert_gate.weight[0], "F32")
    add("output_norm.weight", model.model.norm.weight, "F32")
    linear("output.weight", model.lm_head.weight, 999)
    return write_out(writer, path)
