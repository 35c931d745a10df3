"""The end-to-end benchmark's models: random-weight bf16 Llamas of 1B and 8B shape and a
Qwen3-30B-A3B-like MoE (or tiny ones of the same families), bitsandbytes copies of them, and
their weight memory."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
QWEN3_MOE = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    tie_word_embeddings=False,
)
TINY_MOE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    vocab_size=512,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Shape:
    """One model to build: its label, family (``llama`` or ``qwen3_moe``), config and prefill."""

    label: str
    family: str
    config: dict
    prefill_tokens: int


def shapes(tiny: bool, prefill_tokens: int | None) -> dict[str, Shape]:
    """The ``--sizes`` choices, at full size or tiny (same families, a few layers), with the
    prefill length ``prefill_tokens`` when given."""
    if tiny:
        chosen = {"1b": (TINY_LLAMA, 16), "8b": (TINY_LLAMA, 16), "moe": (TINY_MOE, 16)}
    else:
        chosen = {"1b": (LLAMA_1B, 2048), "8b": (LLAMA_8B, 2048), "moe": (QWEN3_MOE, 1024)}
    labels = {
        "1b": ("Llama-3.2-1B shape", "llama"),
        "8b": ("Llama-3.1-8B shape", "llama"),
        "moe": ("Qwen3-30B-A3B-like MoE", "qwen3_moe"),
    }
    return {
        size: Shape(*labels[size], config, prefill_tokens or tokens)
        for size, (config, tokens) in chosen.items()
    }


def build_model(shape: Shape, device: torch.device) -> nn.Module:
    """A random-weight bf16 model of ``shape`` on ``device`` with SDPA attention, whose greedy
    decoding never stops early (no end-of-sequence token)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    config_class, model_class = families[shape.family]
    config = config_class(**shape.config, max_position_embeddings=8192, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def bnb_quantized(model: nn.Module, kind: str) -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` layers (all but ``lm_head``) are bitsandbytes NF4
    (``kind="bnb-nf4"``, bf16 compute) or LLM.int8 (``"bnb-int8"``, outlier threshold 6.0)
    modules, quantized from the same weights as transformers' loader does with a default
    ``BitsAndBytesConfig`` (blocks of 64, no double quantization). Fused MoE experts stay bf16."""
    import bitsandbytes as bnb

    device = next(model.parameters()).device
    out = copy.deepcopy(model)
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name == "lm_head":
                continue
            bias = child.bias is not None
            new: nn.Module
            if kind == "bnb-nf4":
                new = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=bias,
                    compute_dtype=torch.bfloat16,
                    quant_type="nf4",
                    device="meta",
                )
                new.weight = bnb.nn.Params4bit(
                    child.weight.data,
                    requires_grad=False,
                    quant_type="nf4",
                    compress_statistics=False,  # bnb_4bit_use_double_quant=False, the default
                    module=new,
                ).to(device)
            else:
                new = bnb.nn.Linear8bitLt(
                    child.in_features,
                    child.out_features,
                    bias=bias,
                    has_fp16_weights=False,
                    threshold=6.0,
                    device="meta",
                )
                # Int8Params quantizes when moved from the CPU to the GPU.
                new.weight = bnb.nn.Int8Params(
                    child.weight.data.cpu(), requires_grad=False, has_fp16_weights=False
                ).to(device)
            if bias:
                new.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, new)
            del child
    return out


def weight_gib(model: nn.Module) -> float:
    """GiB of the model's parameters and buffers (each storage once, so tied embeddings count
    once), with bitsandbytes' quantization states (absmax, code, SCB) that live beside them."""
    seen: dict[int, int] = {}

    def count(t: torch.Tensor | None) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in [*model.parameters(), *model.buffers()]:
        count(p)
        count(getattr(p, "SCB", None))
        state = getattr(p, "quant_state", None)
        while state is not None:
            count(state.absmax)
            count(state.code)
            count(getattr(state, "offset", None))
            state = getattr(state, "state2", None)
    return sum(seen.values()) / 2**30
