"""Tiny random Qwen3-MoE / Qwen2-MoE models written as GGUF files by gguf-py, with the experts
stacked as llama.cpp's converter writes them (``blk.N.ffn_{gate,up,down}_exps``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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

import qlens
from qlens.modules import QuantExperts

MOE_ARCHS = ("qwen3moe", "qwen2moe")
NUM_EXPERTS, TOP_K, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS = 4, 2, 256, 2, 4, 2
# transformers' GGUF config reader does not read the expert widths of these architectures
# (expert_feed_forward_length...), so files its loader must read too use the config classes'
# defaults (qlens reads the widths from the file).
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


def assert_experts_are_the_files_blocks(
    experts: torch.nn.Module,
    layer: int,
    types: dict[str, str],
    expected: dict[str, np.ndarray],
    num_experts: int = NUM_EXPERTS,
) -> None:
    """``experts`` (layer ``layer``) is a ``QuantExperts`` over the file's GGUF blocks, stacked
    gate above up, that ``qlens.dequantize`` decodes to exactly gguf-py's values; ``types``: the
    file's GGML type names, ``expected``: gguf-py's values (``gguf_py_values``), by GGUF name."""
    blk = f"blk.{layer}"
    assert isinstance(experts, QuantExperts)
    assert (experts.num_experts, experts.gate.layout) == (num_experts, "stacked")
    for name, payload in experts.payload.items():
        part = "gate" if name == "gate_up_proj" else "down"
        file_type = types[f"{blk}.ffn_{part}_exps.weight"]
        assert payload.format.name == f"gguf_{file_type.lower()}", name
        assert payload.data.dtype == torch.uint8, name
    values = qlens.dequantize(experts)
    gate, up = values["gate_up_proj"].chunk(2, dim=1)
    np.testing.assert_array_equal(gate.numpy(), expected[f"{blk}.ffn_gate_exps.weight"])
    np.testing.assert_array_equal(up.numpy(), expected[f"{blk}.ffn_up_exps.weight"])
    down = values["down_proj"].numpy()
    np.testing.assert_array_equal(down, expected[f"{blk}.ffn_down_exps.weight"])


def assert_expert_reads_are_guarded(
    bridge: object, reference: torch.nn.Module, format_name: str, expert: int
) -> None:
    """Layer 0's ``W_gate`` / ``W_in`` / ``W_out`` of ``bridge`` (packed GGUF experts of
    ``format_name``) are refused, and read inside ``bridge.dequantized()`` the float
    ``reference`` experts module's weights exactly (``W_out`` of one ``expert``)."""
    import pytest

    from qlens.weights import W_gate, W_in, W_out

    for read in (W_in, W_gate, W_out):
        with pytest.raises(NotImplementedError, match="read the experts of layer 0") as error:
            read(bridge, 0)
        assert format_name in str(error.value)
    with bridge.dequantized():  # type: ignore[attr-defined]
        w_gate, w_in, w_out = W_gate(bridge, 0), W_in(bridge, 0), W_out(bridge, 0, expert=expert)
    gate, up = reference.gate_up_proj.chunk(2, dim=1)
    assert torch.equal(w_gate, gate.transpose(-1, -2))  # [experts, d_model, d_mlp]
    assert torch.equal(w_in, up.transpose(-1, -2))
    assert torch.equal(w_out, reference.down_proj[expert].T)  # [d_mlp, d_model]
    with pytest.raises(NotImplementedError, match="read the experts of layer 0"):
        W_in(bridge, 0)  # refused again once the context has exited


def moe_block_outputs(model: torch.nn.Module, layer: int, tokens: torch.Tensor) -> dict[str, Any]:
    """What the MoE block of layer ``layer`` of the HF ``model`` returns on ``tokens``
    (``"mlp"``) and what its router returns (``"router"``: logits, weights, indices)."""
    seen: dict[str, Any] = {}
    mlp = model.model.layers[layer].mlp  # type: ignore[union-attr, index]
    handles = [
        mlp.register_forward_hook(lambda _m, _i, out: seen.update(mlp=out)),
        mlp.gate.register_forward_hook(lambda _m, _i, out: seen.update(router=out)),
    ]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def assert_holds_the_weights_of(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """``model`` (packed experts, float elsewhere) holds exactly ``reference``'s float weights,
    in ``reference``'s dtype: its experts decode to them, its other parameters equal them."""
    dtype = next(reference.parameters()).dtype
    for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
        theirs = reference.model.layers[index].mlp.experts  # type: ignore[union-attr, index]
        assert isinstance(layer.mlp.experts, QuantExperts)
        for leaf, values in qlens.dequantize(layer.mlp.experts, dtype).items():
            assert torch.equal(values, getattr(theirs, leaf)), f"layer {index} {leaf}"
    floats = dict(reference.named_parameters())
    for name, tensor in model.named_parameters():
        assert tensor.dtype == dtype and torch.equal(tensor, floats[name]), name


def assert_reloads_with_the_same_gguf_experts(
    bridge: Any, folder: Path, tokens: torch.Tensor
) -> torch.nn.Module:
    """``save_quantized(bridge, folder)`` then ``load_quantized(folder)`` gives the same GGUF
    expert payloads and logits; returns the reloaded HF model."""
    from qlens.modules.serialization import load_quantized, save_quantized

    save_quantized(bridge, folder)
    reloaded = load_quantized(folder)
    for index, layer in enumerate(reloaded.model.layers):
        experts, saved = layer.mlp.experts, bridge.model.model.layers[index].mlp.experts
        assert isinstance(experts, QuantExperts)
        for name, payload in experts.payload.items():
            assert payload.format == saved.payload[name].format
            assert torch.equal(payload.data, saved.payload[name].data)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, bridge.model(tokens).logits)
    return reloaded
