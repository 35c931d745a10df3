"""Quantized tensor subclasses held as ``nn.Linear.weight``: torchao and optimum-quanto."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.adopt.fp8 import fp8_payload
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.codecs.intcodes import midpoint
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES, validate_int_group
from qlens.quant.codecs.mx import pack_mx
from qlens.quant.codecs.nf4_torchao import nf4_torchao_format
from qlens.quant.codecs.nvfp4 import pack_nvfp4
from qlens.quant.codecs.quanto_bits import packed_quanto_payload, quanto_bits_payload
from qlens.quant.formats import int_group_format
from qlens.quant.libraries import library_of
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


def is_unfrozen_quanto(module: nn.Module) -> bool:
    """An optimum-quanto module not yet frozen: it keeps its float weight, and its forward
    quantizes it on every call (``module.qweight``)."""
    weight = getattr(module, "weight", None)
    return (
        library_of(module) == "optimum.quanto"
        and getattr(module, "weight_qtype", None) is not None
        and type(weight) in (torch.Tensor, nn.Parameter)
    )


def quanto_weight(module: nn.Module) -> Any:
    """The quantized weight an optimum-quanto module's forward uses (frozen or not)."""
    return module.qweight if is_unfrozen_quanto(module) else module.weight


def _swizzle_layout(weight: Any) -> dict[str, object]:
    swizzled = bool(getattr(weight, "is_swizzled_scales", False))
    return {"source": "torchao", "scale_swizzle": "32_4_4" if swizzled else "none"}


def _is_torchao_mx(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return _weight_class(module) in ("MXTensor", "NVFP4Tensor") and library_of(weight) == "torchao"


@register_adopter(
    "torchao MXTensor (MXFP8/MXFP4) and NVFP4Tensor weights (scales plain or swizzled)",
    _is_torchao_mx,
)
def adopt_torchao_mx(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    shape = tuple(int(s) for s in weight.shape)
    if type(weight).__name__ == "NVFP4Tensor":
        if int(weight.block_size) != 16:
            raise NotImplementedError(
                f"torchao NVFP4Tensor with block_size {weight.block_size} is not adopted (NVFP4 "
                "scales blocks of 16)"
            )
        per_tensor = getattr(weight, "per_tensor_scale", None)
        return pack_nvfp4(
            weight.qdata.view(torch.uint8),
            weight.scale,
            torch.tensor(1.0) if per_tensor is None else per_tensor.float(),
            shape,
            layout=_swizzle_layout(weight),
        )
    if int(weight.block_size) != 32 or weight.elem_dtype not in (
        torch.float8_e4m3fn,
        torch.float4_e2m1fn_x2,
    ):
        raise NotImplementedError(
            f"torchao MXTensor with {weight.elem_dtype} elements and block_size "
            f"{weight.block_size} is not adopted; supported: MXFP8 (e4m3) and MXFP4 (e2m1), "
            "blocks of 32"
        )
    qdata = weight.qdata
    if weight.elem_dtype == torch.float4_e2m1fn_x2:
        qdata = qdata.view(torch.uint8)
    return pack_mx(qdata, weight.scale, shape, layout=_swizzle_layout(weight))


def _is_torchao_nf4(module: nn.Module) -> bool:
    return _weight_class(module) == "NF4Tensor" and library_of(module.weight) == "torchao"


@register_adopter(
    "torchao NF4Tensor weights (QLoRA NF4, double-quantized scalers)", _is_torchao_nf4
)
def adopt_torchao_nf4(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    return QuantPayload(
        format=nf4_torchao_format(int(weight.block_size), int(weight.scaler_block_size)),
        data=weight.quantized_data,
        shape=tuple(int(s) for s in weight.shape),
        scales=weight.quantized_scalers,
        layout={
            "packing": "torchao",
            "scaler_block_size": int(weight.scaler_block_size),
            "dtype": str(weight.dtype).removeprefix("torch."),
        },
        extras={
            "quantization_factor": weight.quantization_factor,
            "scaler_mean": weight.scaler_mean,
            "nf4": weight.nf4,
        },
    )


def _is_torchao_intx(module: nn.Module) -> bool:
    return _weight_class(module) == "IntxUnpackedToInt8Tensor"


@register_adopter(
    "torchao IntxUnpackedToInt8Tensor weights (int1-int8 codes held as int8, per row or group)",
    _is_torchao_intx,
)
def adopt_torchao_intx(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    if weight.qdata.dim() != 2:
        raise NotImplementedError(
            f"torchao IntxUnpackedToInt8Tensor of shape {list(weight.qdata.shape)} is not "
            "adopted; supported: 2-D [out, in] linear weights"
        )
    n, k = (int(s) for s in weight.qdata.shape)
    group = _row_block(weight.block_size, k)
    scale = weight.scale.reshape(n, ceil_div(k, group))
    zero = weight.zero_point.reshape(n, ceil_div(k, group))
    has_zero = bool(zero.any())
    payload = QuantPayload(
        format=int_group_format(
            8,
            group,
            zero_point="int" if has_zero else "none",
            scale_dtype=SCALE_DTYPE_NAMES[scale.dtype],
        ),
        data=weight.qdata,
        shape=(n, k),
        scales=scale,
        zeros=zero.to(torch.int8) if has_zero else None,
        layout={"packing": "qlens", "source": "torchao", "target_dtype": str(weight.target_dtype)},
    )
    validate_int_group(payload)
    return payload


def _qtype_bits(module: nn.Module) -> int:
    holder: Any = module
    return int(holder.weight_qtype.bits)


def _is_quanto_bytes(module: nn.Module) -> bool:
    if is_unfrozen_quanto(module):
        return _qtype_bits(module) == 8
    return _weight_class(module) == "WeightQBytesTensor"


_QUANTO_CUDA_BITS = ("AWQWeightQBitsTensor", "MarlinInt4WeightQBitsTensor")


def _is_quanto_bits(module: nn.Module) -> bool:
    if is_unfrozen_quanto(module):
        return _qtype_bits(module) < 8
    return _weight_class(module) in (
        "WeightQBitsTensor",
        "TinyGemmWeightQBitsTensor",
        *_QUANTO_CUDA_BITS,
    )


def _require_axis_0(weight: Any) -> None:
    if weight._axis != 0:
        raise NotImplementedError(
            f"optimum-quanto weights quantized along axis {weight._axis} are not adopted; "
            "supported: axis 0 (one scale per output row or per group along in_features)"
        )


@register_adopter(
    "optimum-quanto QLinear with WeightQBytesTensor (qint8, qfloat8; frozen or not)",
    _is_quanto_bytes,
)
def adopt_quanto_bytes(module: nn.Module) -> QuantPayload:
    weight: Any = quanto_weight(module)
    _require_axis_0(weight)
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


def _per_group(t: torch.Tensor, n: int, groups: int, name: str) -> torch.Tensor:
    """quanto's ``[N * G, 1]`` scale or shift as ``[N, G]``."""
    if t.numel() != n * groups:
        raise ValueError(
            f"optimum-quanto {name} has {t.numel()} values for a weight of {n} rows and {groups} "
            f"groups per row (expected {n * groups}); the tensor does not match its weight"
        )
    return t.reshape(n, groups)


def _qbits_payload(weight: Any, n: int, k: int, group: int) -> QuantPayload:
    """A ``WeightQBitsTensor`` as a quanto payload sharing its packed bytes."""
    packed = weight._data
    if type(packed).__name__ != "PackedTensor" or packed.bits != weight.qtype.bits:
        raise NotImplementedError(
            f"optimum-quanto {weight.qtype} data held as {type(packed).__name__} is not adopted; "
            "expected a PackedTensor of the weight's bit width"
        )
    scale = _per_group(weight._scale, n, k // group, "scale")
    shift = _per_group(weight._shift, n, k // group, "shift")
    return packed_quanto_payload(
        packed._data, (n, k), scale, shift, bits=weight.qtype.bits, group_size=group
    )


def _tinygemm_payload(weight: Any, n: int, k: int, group: int) -> QuantPayload:
    """A ``TinyGemmWeightQBitsTensor``: codes through its own unpack, then quanto's shift.

    tinygemm stores ``[K/g, N, 2]`` (scale, midpoint shift ``8*s - shift``); quanto's
    dequantize recovers ``shift = 8*s - stored`` in the scales' dtype, and so does this.
    """
    scale_shift = weight._scale_shift
    scale = scale_shift[:, :, 0].t()
    shift = midpoint(weight.qtype.bits) * scale - scale_shift[:, :, 1].t()
    return quanto_bits_payload(
        weight._data.unpack().reshape(n, k),
        scale.contiguous(),
        shift.contiguous(),
        bits=weight.qtype.bits,
        group_size=group,
        source="optimum-quanto tinygemm",
    )


@register_adopter(
    "optimum-quanto WeightQBitsTensor (qint4/qint2, float or integer shift; TinyGemm on CPU; "
    "frozen or not)",
    _is_quanto_bits,
)
def adopt_quanto_bits(module: nn.Module) -> QuantPayload:
    weight: Any = quanto_weight(module)
    name = type(weight).__name__
    if name in _QUANTO_CUDA_BITS:
        raise NotImplementedError(
            f"optimum-quanto {weight.qtype} weights in the CUDA {name} layout are not adopted "
            "(its packing is kernel-specific); adopt them before moving the model to CUDA, or "
            "move it to CPU first (module.to('cpu') converts them back to WeightQBitsTensor)"
        )
    _require_axis_0(weight)
    if weight.dim() != 2:
        raise NotImplementedError(
            f"optimum-quanto {weight.qtype} weights of shape {list(weight.shape)} are not "
            "adopted; supported: 2-D [out, in] linear weights"
        )
    n, k = (int(s) for s in weight.shape)
    group = int(weight._group_size or k)
    if name == "TinyGemmWeightQBitsTensor":
        return _tinygemm_payload(weight, n, k, group)
    return _qbits_payload(weight, n, k, group)
