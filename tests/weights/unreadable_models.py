"""A tiny Llama whose linear layers hold each kind of weight the guard refuses.

``KINDS`` maps a name to a factory turning a float ``nn.Linear`` into a module of that kind.
Each kind is also a plain tensor (``raw_tensor``) for weights that are not linear layers.
"""

from __future__ import annotations

import copy
import warnings

import torch
import transformers
from torch import nn

from qlens.bridge import Bridge

HIDDEN, HEADS, KV_HEADS, D_HEAD, MLP, VOCAB = 128, 4, 2, 32, 256, 64


def float_model(n_layers: int = 1) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=n_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=D_HEAD,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _bnb_int8(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    module = bnb.nn.Linear8bitLt(
        linear.in_features, linear.out_features, bias=False, has_fp16_weights=False
    )
    module.weight = bnb.nn.Int8Params(
        linear.weight.detach().clone(), requires_grad=False, has_fp16_weights=False
    )
    return module.to("cpu")


def _bnb_nf4(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    module = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=False, quant_type="nf4",
        compute_dtype=torch.float32,
    )  # fmt: skip
    module.weight = bnb.nn.Params4bit(
        linear.weight.detach().clone(), requires_grad=False, quant_type="nf4"
    )
    return module.to("cpu")


def _compressed_int4(linear: nn.Linear) -> nn.Module:
    """compressed-tensors W4A16 pack-quantized (int32 words), compressed with its own API."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    holder = nn.Sequential(copy.deepcopy(linear))
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(holder, QuantizationConfig(config_groups={"g": scheme}))
        module = holder[0]
        args = module.quantization_scheme.weights
        grouped = module.weight.detach().unflatten(-1, (-1, args.group_size))
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
        ModelCompressor.from_pretrained_model(holder).compress_model(holder)
    return holder[0]


def _hf_fp8(linear: nn.Linear) -> nn.Module:
    from transformers.integrations.finegrained_fp8 import FP8Linear

    module = FP8Linear(linear.in_features, linear.out_features, block_size=(32, 32))
    generator = torch.Generator().manual_seed(linear.out_features)
    with torch.no_grad():
        values = torch.randn(module.weight.shape, generator=generator) * 50
        module.weight.copy_(values.clamp(-448, 448).to(torch.float8_e4m3fn))
        module.weight_scale_inv.copy_(
            torch.rand(module.weight_scale_inv.shape, generator=generator)
        )
    return module


def _torchao_int8(linear: nn.Linear) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    holder = nn.Sequential(copy.deepcopy(linear))
    quantize_(holder, Int8WeightOnlyConfig())
    return holder[0]


def _qlens_mxfp4(linear: nn.Linear) -> nn.Module:
    from qlens.modules import QuantLinear
    from qlens.quant.quantize import quantize_weight

    return QuantLinear(quantize_weight(linear.weight.detach(), "mxfp4"))


class PackedWrapper:
    """Stands in for a non-tensor weight object (e.g. a kernel library's MXFP4 tensor wrapper)."""

    shape = (0,)


class _WrapperLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = PackedWrapper()


def _meta(linear: nn.Linear) -> nn.Module:
    return nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")


KINDS = {
    "int8": _bnb_int8,
    "packed_uint8": _bnb_nf4,
    "int32": _compressed_int4,
    "float8": _hf_fp8,
    "tensor_subclass": _torchao_int8,
    "qlens_payload": _qlens_mxfp4,
    "non_tensor": _WrapperLinear,
    "meta": _meta,
}
# The quantization_config.quant_method transformers records for such checkpoints (None: a
# model quantized by qlens itself, or not quantized at all).
QUANT_METHOD = {
    "int8": "bitsandbytes",
    "packed_uint8": "bitsandbytes",
    "int32": "compressed-tensors",
    "float8": "fp8",
    "tensor_subclass": "torchao",
    "qlens_payload": None,
    "non_tensor": "mxfp4",
    "meta": None,
}
# Regular expressions for the reason and the quantization method the error names, per kind
# (None: the error names no method).
EXPECTED = {
    "int8": (r"integer dtype torch\.int8", "bitsandbytes"),
    "packed_uint8": (r"integer dtype torch\.uint8 and shape \[\d+, 1\]", "bitsandbytes"),
    "int32": (r"integer dtype torch\.int32", "compressed-tensors"),
    "float8": (r"1-byte float dtype torch\.float8_e4m3fn", "fp8"),
    "tensor_subclass": (r"quantized tensor subclass torchao\.", "torchao"),
    "qlens_payload": (r"integer dtype torch\.uint8", r"qlens mxfp4 payload \(QuantLinear\)"),
    "non_tensor": (r"not a torch\.Tensor but a .*PackedWrapper", "mxfp4"),
    "meta": (r"meta device", None),  # not a quantization problem: no method is named
}
# Kinds with an exact dequantization route (the others raise even when opted in).
DEQUANTIZABLE = ("int8", "packed_uint8", "int32", "float8", "tensor_subclass", "qlens_payload")


def swapped_bridge(kind: str, n_layers: int = 1) -> Bridge:
    """A bridge whose every linear layer (lm_head included) is replaced by ``kind``."""
    model = float_model(n_layers)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, KINDS[kind](module))
    if QUANT_METHOD[kind] is not None:
        model.config.quantization_config = {"quant_method": QUANT_METHOD[kind]}
    return Bridge(model)
