"""Checkpoints in transformers' on-disk layouts that transformers cannot write on a CPU.

FP8 (fine-grained, ``quant_method: fp8``): e4m3 ``weight`` plus fp32 ``weight_scale_inv`` per
128 x 128 block. GPT-OSS MXFP4 (``quant_method: mxfp4``): experts as ``*_blocks [E, N, K/32, 16]``
and ``*_scales [E, N, K/32]``, the other tensors in float.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from qlens.quant.codecs.mx import mxfp4_to_gpt_oss
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight


def write_fp8_block_checkpoint(path: Path) -> dict[str, QuantPayload]:
    """A 1-layer Llama whose projections are FP8 blocks; returns the payloads by weight name."""
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    payloads = {}
    for name in [n for n in state if n.endswith("proj.weight")]:
        payloads[name] = quantize_weight(state[name] * 0.02, "fp8-block")
        state[name] = payloads[name].data
        state[name.replace(".weight", ".weight_scale_inv")] = payloads[name].scales
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    config.quantization_config = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }  # fmt: skip
    config.save_pretrained(path)
    return payloads


def write_gpt_oss_mxfp4_checkpoint(path: Path) -> dict[str, QuantPayload]:
    """A 1-layer GPT-OSS with MXFP4 experts; returns the ``[E, out, in]`` payloads by key."""
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    state = transformers.GptOssForCausalLM(config).state_dict()
    payloads = {}
    for proj in ("gate_up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{proj}"
        weight = state.pop(key).transpose(1, 2).contiguous() * 0.02
        payloads[key] = quantize_weight(weight, "mxfp4")
        state[f"{key}_blocks"], state[f"{key}_scales"] = mxfp4_to_gpt_oss(payloads[key])
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(path)
    return payloads
