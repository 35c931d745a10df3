"""Tiny random Llama and Mixtral models written as GGUF files by gguf-py, the way llama.cpp's
converter does (Mixtral as architecture ``llama`` with stacked ``blk.N.ffn_{gate,up,down}_exps``
experts and a float ``ffn_gate_inp`` router)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

# Types gguf-py's quantize() writes (it has no quantizer for the K-quants).
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
# K-quants: byte offsets of each block's fp16 super-scales in gguf-py's layout (d, dmin...).
K_QUANT_F16_OFFSETS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

_ATTENTION_LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
}
_MLP_LINEARS = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


# Every linear's input width a multiple of 256 (one K-quant block).
_SIZES = dict(
    vocab_size=64,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_gguf_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random Llama whose linears' input widths are multiples of 256 (one K-quant block)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_SIZES)).eval()


def make_gguf_mixtral(seed: int = 0, experts: int = 4, top_k: int = 2) -> MixtralForCausalLM:
    """A random Mixtral of ``make_gguf_llama``'s sizes; each expert 512 wide (two K-quant blocks)."""
    torch.manual_seed(seed)
    config = MixtralConfig(**_SIZES, num_local_experts=experts, num_experts_per_tok=top_k)
    return MixtralForCausalLM(config).eval()


def transformers_gguf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' own GGUF load of ``path`` (it dequantizes every tensor with gguf-py)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
    ).eval()


def gguf_py_values(reader: object) -> dict[str, np.ndarray]:
    """gguf-py's dequantization of every tensor in a file, keyed by GGUF name."""
    from gguf.quants import dequantize

    return {
        t.name: dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist())
        for t in reader.tensors  # type: ignore[attr-defined]
    }


def float_mixtral(path: Path, config: MixtralConfig) -> MixtralForCausalLM:
    """A float Mixtral of ``config`` holding gguf-py's values of the file at ``path`` (experts
    stacked), placed by hand: q/k rows back in HF order, each layer's gate rows above its up
    rows."""
    from gguf import GGUFReader

    file_values = gguf_py_values(GGUFReader(str(path)))
    values = {name: torch.from_numpy(np.array(v)) for name, v in file_values.items()}
    state = {
        "model.embed_tokens.weight": values["token_embd.weight"],
        "model.norm.weight": values["output_norm.weight"],
        "lm_head.weight": values["output.weight"],
    }
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):
        layer, blk = f"model.layers.{i}", f"blk.{i}"
        for hf_name, gguf_name in _ATTENTION_LINEARS.items():
            weight = values[f"{blk}.{gguf_name}.weight"]
            if gguf_name in heads:  # q/k rows back in HF order
                weight = torch.from_numpy(unpermute_rows(weight.numpy(), heads[gguf_name]))
            state[f"{layer}.{hf_name}.weight"] = weight
        state[f"{layer}.input_layernorm.weight"] = values[f"{blk}.attn_norm.weight"]
        state[f"{layer}.post_attention_layernorm.weight"] = values[f"{blk}.ffn_norm.weight"]
        state[f"{layer}.mlp.gate.weight"] = values[f"{blk}.ffn_gate_inp.weight"]
        gate_up = [values[f"{blk}.ffn_{part}_exps.weight"] for part in ("gate", "up")]
        state[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat(gate_up, dim=1)
        state[f"{layer}.mlp.experts.down_proj"] = values[f"{blk}.ffn_down_exps.weight"]
    model = MixtralForCausalLM(config).eval()
    model.load_state_dict(state, strict=True)
    return model


def permute_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def unpermute_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k row order back from llama.cpp's (the inverse of ``permute_rows``)."""
    shape = weights.shape
    return (
        weights.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def random_k_quant_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks of a K-quant: random codes and sub-scales, small finite fp16 scales."""
    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_F16_OFFSETS[type_name]:
        scales = rng.uniform(1e-3, 1e-2, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = (
            scales[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
        )
    return blocks.reshape(rows, -1)


def encode_weight(
    name: str, weights: np.ndarray, type_name: str, seed: int
) -> tuple[np.ndarray, GGMLQuantizationType]:
    qtype = GGMLQuantizationType[type_name]
    if type_name in ("F32", "F16"):
        return weights.astype(np.float32 if type_name == "F32" else np.float16), qtype
    if type_name in K_QUANT_F16_OFFSETS:
        return random_k_quant_blocks(type_name, *weights.shape, seed=seed), qtype
    return quantize(weights, qtype), qtype


def encode_stacked(
    weight: torch.Tensor, type_name: str, seed: int
) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Expert weights ``[experts, out, in]`` encoded as ``type_name``; K-quant blocks are random
    (gguf-py has no K-quant quantizer), with their own seed per expert."""
    values = weight.float().numpy()
    if type_name not in K_QUANT_F16_OFFSETS:
        return encode_weight("", values, type_name, seed)
    encoded = [encode_weight("", v, type_name, 1000 * seed + e)[0] for e, v in enumerate(values)]
    return np.stack(encoded), GGMLQuantizationType[type_name]


def add_stacked_experts(
    writer: GGUFWriter,
    layer: int,
    experts: torch.nn.Module,
    type_of: Callable[[str], str],
    *,
    experts_written: int | None = None,
    omit: tuple[str, ...] = (),
) -> None:
    """Write a fused experts module (``gate_up_proj`` gate rows above up rows, ``down_proj``) as
    llama.cpp's three stacked tensors of layer ``layer``; ``experts_written`` keeps only that many
    experts, ``omit`` leaves out the tensors of those GGUF names."""
    for part, (data, qtype) in _encoded_experts(layer, experts, type_of, experts_written).items():
        name = f"blk.{layer}.ffn_{part}_exps.weight"
        if name not in omit:
            writer.add_tensor(name, data, raw_dtype=qtype)


def add_per_expert_tensors(
    writer: GGUFWriter,
    layer: int,
    experts: torch.nn.Module,
    type_of: Callable[[str], str],
    *,
    omit: tuple[str, ...] = (),
    retype: dict[str, str] | None = None,
) -> None:
    """Write a fused experts module as llama.cpp wrote Mixtral before stacking experts: one
    tensor per expert, ``blk.N.ffn_{gate,up,down}.E.weight``, each holding exactly the bytes of
    expert E of ``add_stacked_experts``' tensor (``type_of`` is asked the stacked name). Broken
    files: ``omit`` leaves out the tensors of those names, ``retype`` writes those in another
    type."""
    retype = retype or {}
    weights = _expert_weights(experts, None)
    encoded = _encoded_experts(layer, experts, type_of, None)
    for seed, (part, (data, qtype)) in enumerate(encoded.items()):
        for expert, expert_data in enumerate(data):
            name = f"blk.{layer}.ffn_{part}.{expert}.weight"
            if name in omit:
                continue
            written, written_type = expert_data, qtype
            if name in retype:
                values = weights[part][expert].float().numpy()
                written, written_type = encode_weight(name, values, retype[name], seed)
            writer.add_tensor(name, written, raw_dtype=written_type)


def _expert_weights(experts: torch.nn.Module, kept: int | None) -> dict[str, torch.Tensor]:
    gate, up = experts.gate_up_proj.detach()[:kept].chunk(2, dim=1)
    return {"gate": gate, "up": up, "down": experts.down_proj.detach()[:kept]}


def _encoded_experts(
    layer: int, experts: torch.nn.Module, type_of: Callable[[str], str], kept: int | None
) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """Each projection's experts encoded as ``type_of`` names its stacked tensor."""
    return {
        part: encode_stacked(
            weight, type_of(f"blk.{layer}.ffn_{part}_exps.weight"), 10 * layer + seed
        )
        for seed, (part, weight) in enumerate(_expert_weights(experts, kept).items())
    }


def write_gguf_llama(
    model: PreTrainedModel,
    path: Path,
    type_of: Callable[[str], str],
    extra: dict[str, np.ndarray] | None = None,
    *,
    expert_count: int | None = None,
    experts_written: int | None = None,
    omit: tuple[str, ...] = (),
    per_expert: bool = False,
    retype: dict[str, str] | None = None,
) -> Path:
    """Write a Llama or Mixtral ``model`` to ``path`` as llama.cpp does (architecture ``llama``);
    ``type_of(gguf_tensor_name)`` names each linear's GGML type, ``extra`` holds more float32
    tensors to write by GGUF name; ``per_expert``: Mixtral experts one tensor each, as llama.cpp
    wrote them before stacking (``add_per_expert_tensors``). Broken Mixtral files:
    ``expert_count`` writes that count in the metadata instead of the model's, ``experts_written``
    keeps only that many (stacked) experts, ``omit`` leaves out the tensors of those GGUF names,
    ``retype`` writes those per-expert tensors in another type."""
    config = model.config
    writer = gguf_writer(path, "llama", config)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    moe = isinstance(config, MixtralConfig)
    if moe:
        writer.add_expert_count(expert_count or config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)

    def add(name: str, tensor: torch.Tensor, type_name: str, seed: int = 0) -> None:
        if name not in omit:
            data, qtype = encode_weight(name, tensor.detach().float().numpy(), type_name, seed)
            writer.add_tensor(name, data, raw_dtype=qtype)

    linears = _ATTENTION_LINEARS if moe else _ATTENTION_LINEARS | _MLP_LINEARS
    add("token_embd.weight", model.model.embed_tokens.weight, "F32")
    for index, layer in enumerate(model.model.layers):
        add(f"blk.{index}.attn_norm.weight", layer.input_layernorm.weight, "F32")
        add(f"blk.{index}.ffn_norm.weight", layer.post_attention_layernorm.weight, "F32")
        for seed, (hf_name, gguf_name) in enumerate(linears.items()):
            weight = layer.get_submodule(hf_name).weight.detach()
            if gguf_name == "attn_q":
                weight = torch.from_numpy(permute_rows(weight.numpy(), config.num_attention_heads))
            elif gguf_name == "attn_k":
                weight = torch.from_numpy(permute_rows(weight.numpy(), config.num_key_value_heads))
            name = f"blk.{index}.{gguf_name}.weight"
            add(name, weight, type_of(name), seed=100 * index + seed)
        if moe:
            add(f"blk.{index}.ffn_gate_inp.weight", layer.mlp.gate.weight, "F32")
            if per_expert:
                add_per_expert_tensors(
                    writer, index, layer.mlp.experts, type_of, omit=omit, retype=retype
                )
            else:
                add_stacked_experts(
                    writer, index, layer.mlp.experts, type_of,
                    experts_written=experts_written, omit=omit,
                )  # fmt: skip
    add("output_norm.weight", model.model.norm.weight, "F16")
    add("output.weight", model.lm_head.weight, type_of("output.weight"), seed=999)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    return write_out(writer, path)


def gguf_writer(path: Path, arch: str, config: PretrainedConfig) -> GGUFWriter:
    """A GGUF writer for ``arch`` holding the metadata every decoder file has, from ``config``."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    return writer


def write_out(writer: GGUFWriter, path: Path) -> Path:
    """Write the header, metadata and tensors ``writer`` holds to ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
