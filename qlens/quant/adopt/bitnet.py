"""transformers BitNet modules: ``BitLinear`` (packed uint8) and offline ``AutoBitLinear``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.bitnet import PACKING, bitnet_format, pack_ternary
from qlens.quant.payload import QuantPayload


def _is_bitlinear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "BitLinear"
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.uint8
        and isinstance(getattr(module, "weight_scale", None), torch.Tensor)
    )


def _is_offline_autobitlinear(module: nn.Module) -> bool:
    # Online AutoBitLinear re-quantizes a float master weight each forward: nothing is stored
    # quantized, so it is not adopted.
    return (
        type(module).__name__ == "AutoBitLinear"
        and not getattr(module, "online_quant", False)
        and isinstance(getattr(module, "weight_scale", None), torch.Tensor)
    )


@register_adopter("transformers BitLinear (uint8 ternary, W = T / weight_scale)", _is_bitlinear)
def adopt_bitlinear(module: nn.Module) -> QuantPayload:
    m: Any = module
    return QuantPayload(
        format=bitnet_format("divide"),
        data=m.weight,
        shape=(int(m.out_features), int(m.in_features)),
        global_scale=m.weight_scale,
        layout={"packing": PACKING},
    )


@register_adopter(
    "transformers AutoBitLinear, offline (ternary weight, W = T * weight_scale)",
    _is_offline_autobitlinear,
)
def adopt_autobitlinear(module: nn.Module) -> QuantPayload:
    m: Any = module
    return QuantPayload(
        format=bitnet_format("multiply"),
        data=pack_ternary(m.weight.detach()),
        shape=tuple(m.weight.shape),
        global_scale=m.weight_scale,
        layout={"packing": PACKING},
    )
