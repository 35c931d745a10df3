"""Load FP8-block and GPT-OSS MXFP4 checkpoints with their weights packed, on any device.

transformers dequantizes both to bf16 on the CPU (its FP8 and MXFP4 matmuls need CUDA kernels),
doubling memory and bypassing qlens' quantized forward. Here the model is built on the meta
device from its config, and the safetensors shards are streamed: a linear's e4m3 ``weight`` and
``weight_scale_inv`` (transformers' fine-grained FP8, ``quant_method: fp8`` with
``weight_block_size``) become a ``QuantLinear`` over an ``fp8_block`` payload; GPT-OSS experts'
``*_blocks`` / ``*_scales`` (``quant_method: mxfp4``) a ``QuantExperts`` over ``mxfp4`` payloads;
every other tensor is put in place in the load dtype. Payloads are read by the same functions
that adopt transformers' own modules (``qlens.quant.adopt.fp8`` / ``gpt_oss``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlens.quant.guards import quantization_method

# The tensors each packed module kind needs before it can be built, by name inside the module.
_FP8_LINEAR = ("weight", "weight_scale_inv")
_MXFP4_EXPERTS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "down_proj_blocks",
    "down_proj_scales",
)


def packs_on_load(config: Any) -> bool:
    """Whether ``config``'s quantization is one this module loads packed."""
    method = quantization_method(config)
    qconfig = getattr(config, "quantization_config", None)
    block = (
        qconfig.get("weight_block_size")
        if isinstance(qconfig, dict)
        else getattr(qconfig, "weight_block_size", None)
    )
    if method == "fp8":
        return block is not None
    return method == "mxfp4" and getattr(config, "model_type", None) == "gpt_oss"


def load_packed(
    directory: str | Path, config: Any, *, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The model in ``directory`` with its FP8-block linears / MXFP4 experts kept packed."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from qlens.load_checks import key_list
    from qlens.quantize_on_load import cast_like_from_pretrained, put_tensor, safetensors_shards

    qconfig = config.quantization_config
    block = qconfig.get("weight_block_size") if isinstance(qconfig, dict) else None
    block = block or getattr(qconfig, "weight_block_size", None)
    plain = copy.deepcopy(config)
    del plain.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype)
    expected = dict(model.state_dict(keep_vars=True))
    shards = safetensors_shards(directory)
    needs = _packed_modules(model, shards)
    held: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    unscaled: list[str] = []
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as reader:
            for key in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                owner, _, leaf = key.rpartition(".")
                packed = leaf in needs.get(owner, ())
                if not packed and key not in expected:
                    unexpected.append(key)
                    continue
                tensor = reader.get_tensor(key)
                if not packed and tensor.element_size() == 1:
                    unscaled.append(key)  # quantized codes whose scales are missing
                    continue
                if not packed:
                    value = cast_like_from_pretrained(tensor, expected[key], dtype, device)
                    put_tensor(model, key, value)
                    loaded.add(key)
                    continue
                parts = held.setdefault(owner, {})
                parts[leaf] = tensor.to(device)
                if len(parts) == len(needs[owner]):
                    module = model.get_submodule(owner)
                    model.set_submodule(owner, _build(module, held.pop(owner), block, dtype))
                    loaded.update(f"{owner}.{n}" for n, _ in module.named_parameters())
    if unscaled:
        raise ValueError(
            f"{directory} lacks tensors for {key_list(unscaled)}: they hold 1-byte quantized "
            "codes but the checkpoint has no scales for them (weight_scale_inv / *_scales); "
            "qlens does not read codes as weights."
        )
    if unexpected:
        raise ValueError(
            f"{directory} holds tensors {key_list(unexpected)} that {type(model).__name__} has "
            "no place for; the checkpoint does not match its config."
        )
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target not in loaded and source in loaded:
            put_tensor(model, target, model.get_parameter(source))
            loaded.add(target)
    left = sorted(set(expected) - loaded)
    if left or held:
        raise ValueError(
            f"{directory} lacks tensors {key_list([*left, *held])}: the checkpoint is incomplete "
            "for its config, and qlens does not fill weights with random values."
        )
    model.to(device)
    return model.eval()


def _packed_modules(model: nn.Module, shards: list[Path]) -> dict[str, tuple[str, ...]]:
    """Module path -> the checkpoint tensors (names inside it) its packed module is built from.

    An FP8 linear is one with a ``weight_scale_inv`` (layers left unquantized, such as
    ``lm_head``, have none); GPT-OSS experts are the ones with ``gate_up_proj_blocks``.
    """
    from safetensors import safe_open

    keys: list[str] = []
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as reader:
            keys += list(reader.keys())
    needs: dict[str, tuple[str, ...]] = {}
    for key in keys:
        owner, _, leaf = key.rpartition(".")
        if leaf == "weight_scale_inv":
            module: Any = model.get_submodule(owner)
            needs[owner] = _FP8_LINEAR + (("bias",) if module.bias is not None else ())
        elif leaf == "gate_up_proj_blocks":
            module = model.get_submodule(owner)
            biases = tuple(b for b in ("gate_up_proj_bias", "down_proj_bias") if hasattr(module, b))
            needs[owner] = _MXFP4_EXPERTS + biases
    return needs


def _build(
    module: nn.Module, parts: dict[str, torch.Tensor], block: Any, dtype: torch.dtype
) -> nn.Module:
    from qlens.modules import QuantExperts, QuantLinear
    from qlens.modules.hf_experts import expert_gate_of
    from qlens.quant.adopt.fp8 import fp8_payload
    from qlens.quant.adopt.gpt_oss import gpt_oss_payload

    if isinstance(module, nn.Linear):
        bias = parts.get("bias")
        payload = fp8_payload(parts["weight"], parts["weight_scale_inv"], block)
        return QuantLinear(payload, None if bias is None else bias.to(dtype))
    gate = expert_gate_of(module)
    if isinstance(gate, str):
        raise ValueError(f"qlens cannot run the MXFP4 experts {type(module).__name__}: {gate}")
    biases = [parts.get(n) for n in ("gate_up_proj_bias", "down_proj_bias")]
    return QuantExperts(
        gpt_oss_payload(parts["gate_up_proj_blocks"], parts["gate_up_proj_scales"], "gate_up_proj"),
        gpt_oss_payload(parts["down_proj_blocks"], parts["down_proj_scales"], "down_proj"),
        gate,
        *(None if b is None else b.to(dtype) for b in biases),
    )
