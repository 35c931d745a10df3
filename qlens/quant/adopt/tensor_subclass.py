"""Quantized tensor subclasses held as ``nn.Linear.weight``: torchao and optimum-quanto."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.adopt.fp8 import fp8_payload
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES, validate_int_group
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload


def _weight_class(module: nn.Module) -> str:
    return type(getattr(module, "weight", None)).__name__


def _int8_payload(
    qdata: torch.Tensor, scale: torch.Tensor, group: int, source: str
) -> QuantPayload:
    """qlens int8 payload of a symmetric ``W = q * s`` weight with one scale per ``group``."""
    n, k = qdata.shape
    scale = scale.reshape(n, ceil_div(k, group))
    payload = QuantPayload(
        format=int_group_format(8, group, scale_dtype=SCALE_DTYPE_NAMES[scale.dtype]),
        data=qdata,
        shape=(n, k),
        scales=scale,
        layout={"packing": "qlens", "source": source},
    )
    validate_int_group(payload)
    return payload


def _row_block(block_size: Any, k: int) -> int:
    rows, cols = (int(b) for b in block_size)
    if rows != 1:
        raise NotImplementedError(
            f"torchao weights with block_size {list(block_size)} (more than one row per scale) "
            "are not adopted; supported: per-row and per-group blocks [1, g]"
        )
    return min(cols, k)


def _is_torchao(module: nn.Module) -> bool:
    return _weight_class(module) in ("Int8Tensor", "Float8Tensor")


@register_adopter(
    "torchao Int8Tensor / Float8Tensor weights (quantize_ with *WeightOnlyConfig)", _is_torchao
)
def adopt_torchao(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    zero = getattr(weight, "zero_point", None)
    if isinstance(zero, torch.Tensor) and bool(zero.any()):
        raise NotImplementedError("asymmetric torchao Int8Tensor weights are not adopted")
    k = int(weight.qdata.shape[-1])
    group = _row_block(weight.block_size, k)
    if type(weight).__name__ == "Int8Tensor":
        return _int8_payload(weight.qdata, weight.scale, group, "torchao")
    payload = fp8_payload(weight.qdata, weight.scale.float(), (1, group))
    payload.layout["source"] = "torchao"
    return payload


def _is_quanto_bytes(module: nn.Module) -> bool:
    return _weight_class(module) == "WeightQBytesTensor"


def _is_quanto_bits(module: nn.Module) -> bool:
    return _weight_class(module) in ("WeightQBitsTensor", "TinyGemmWeightQBitsTensor")


@register_adopter(
    "optimum-quanto QLinear with WeightQBytesTensor (qint8, qfloat8)", _is_quanto_bytes
)
def adopt_quanto_bytes(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    if weight._axis != 0:
        raise NotImplementedError(
            f"optimum-quanto weights quantized along axis {weight._axis} are not adopted; "
            "supported: axis 0 (one scale per output row)"
        )
    data, scale = weight._data, weight._scale
    k = int(data.shape[-1])
    if data.dtype == torch.int8:
        return _int8_payload(data, scale, k, "optimum-quanto")
    if data.dtype == torch.float8_e4m3fn:
        payload = fp8_payload(data, scale.float(), (1, k))  # bf16/fp16 -> fp32 is exact
        payload.layout["source"] = "optimum-quanto"
        return payload
    raise NotImplementedError(
        f"optimum-quanto {weight.qtype} weights are not adopted; supported: qint8, qfloat8_e4m3fn"
    )


@register_adopter(
    "optimum-quanto WeightQBitsTensor (qint4/qint2): recognised, not adoptable", _is_quanto_bits
)
def adopt_quanto_bits(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    raise NotImplementedError(
        f"optimum-quanto {weight.qtype} weights ({type(weight).__name__}) store a float shift "
        "(W = scale * q - shift), which no qlens payload format expresses exactly; read them with "
        "module.weight.dequantize() or re-quantize the float weights with qlens"
    )
