"""torchao's int4 weight tensors (``Int4WeightOnlyConfig``), read into qlens payloads.

- ``Int4Tensor`` (packing "plain", mslk kernels): signed nibbles, low nibble first, with a
  scale and a float zero point ``[K/g, N]``: the float-zero int4 payload, sharing ``qdata``.
- ``Int4PlainInt32Tensor`` with int8 zero points (packing "plain_int32", Intel XPU): unsigned
  nibbles, low first, four bytes to an int32, ``W = (q - z) * s``: exactly the qlens int4 layout,
  sharing ``qdata``. Its Ascend NPU variant (float zero points, codes interleaved by
  ``npu_convert_weight_to_int4pack``) is refused.
- ``Int4TilePackedTo4dTensor`` (tinygemm's CUDA tensor-core tiles): on a CUDA device the codes
  are read back through tinygemm's own kernel (an identity matmul with unit scales and zero
  zero points returns ``q - 8`` exactly); elsewhere it is refused.
- ``Int4PreshuffledTensor`` (mslk's WGMMA-preshuffled bytes, no documented layout) is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.codecs.int4_float_zero import int4_float_zero_payload, pack_int4_float_zero
from qlens.quant.codecs.intcodes import midpoint
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES, validate_int_group
from qlens.quant.formats import int_group_format
from qlens.quant.libraries import library_of
from qlens.quant.payload import QuantPayload

INT4_CLASSES = (
    "Int4Tensor",
    "Int4PlainInt32Tensor",
    "Int4TilePackedTo4dTensor",
    "Int4PreshuffledTensor",
)
_OTHER_CONFIG = (
    "quantize with torchao's IntxWeightOnlyConfig(weight_dtype=torch.int4, "
    "granularity=PerGroup(g)) or Int4WeightOnlyConfig(int4_packing_format='plain'), which qlens "
    "reads, or load the float model and quantize it with qlens.quantize(bridge, 'int4')"
)
# Rows of the identity matrix sent through tinygemm at once when reading codes back.
_UNPACK_ROWS = 1024


def _int4_class(module: nn.Module) -> str | None:
    weight = getattr(module, "weight", None)
    name = type(weight).__name__
    return name if name in INT4_CLASSES and library_of(weight) == "torchao" else None


def torchao_int4_forward_problem(module: nn.Module) -> str | None:
    """Why the forward of a torchao int4 weight cannot run here (None: it can, or no such weight)."""
    name = _int4_class(module)
    if name is None:
        return None
    weight: Any = module.weight
    device = weight.device.type
    if name in ("Int4Tensor", "Int4PreshuffledTensor"):
        if device != "cuda":
            return f"its forward runs mslk's CUDA kernels; the weight is on {device}"
        if not hasattr(torch.ops, "mslk") or not hasattr(torch.ops.mslk, "bf16i4bf16_rowwise"):
            return "its forward runs mslk's CUDA kernels, and mslk is not loaded"
        return None
    if name == "Int4PlainInt32Tensor":
        if device not in ("xpu", "npu"):
            return f"its forward runs only on Intel XPU or Ascend NPU; the weight is on {device}"
        return None
    if device != "cuda":
        return f"its forward runs tinygemm's CUDA kernel; the weight is on {device}"
    return None


def _require_linear_weight(weight: Any, name: str) -> int:
    """The group size of a 2-D, groupwise, weight-only torchao int4 weight (raises otherwise)."""
    if getattr(weight, "act_pre_scale", None) is not None:
        raise NotImplementedError(
            f"torchao {name} with an act_pre_scale (activations multiplied by a per-channel "
            "scale before the matmul, e.g. AWQ) is not adopted: qlens' payload holds the weight "
            f"alone; {_OTHER_CONFIG}"
        )
    if weight.dim() != 2:
        raise NotImplementedError(
            f"torchao {name} of shape {list(weight.shape)} is not adopted; supported: 2-D "
            f"[out, in] linear weights. To read it, {_OTHER_CONFIG}"
        )
    block = [int(b) for b in weight.block_size]
    if len(block) != 2 or block[0] != 1:
        raise NotImplementedError(
            f"torchao {name} with block_size {block} is not adopted; supported: groups [1, g]. "
            f"To read it, {_OTHER_CONFIG}"
        )
    return block[1]


def _per_row(t: torch.Tensor, n: int, groups: int, what: str, name: str) -> torch.Tensor:
    """torchao's ``[K/g, N]`` scale or zero point as ``[N, K/g]`` (a small contiguous copy)."""
    if tuple(t.shape) != (groups, n):
        raise ValueError(
            f"torchao {name} {what} has shape {list(t.shape)}, expected [K/g, N] = "
            f"{[groups, n]}; the tensor does not match its weight"
        )
    return t.t().contiguous()


def _plain_payload(weight: Any) -> QuantPayload:
    """``Int4Tensor``: its signed nibbles shared, its scale and zero point transposed."""
    group = _require_linear_weight(weight, "Int4Tensor")
    n, k = (int(s) for s in weight.shape)
    groups = ceil_div(k, group)
    return int4_float_zero_payload(
        weight.qdata.view(torch.uint8),
        (n, k),
        _per_row(weight.scale, n, groups, "scale", "Int4Tensor"),
        _per_row(weight.zero_point, n, groups, "zero_point", "Int4Tensor"),
        group_size=group,
        source="torchao Int4Tensor",
    )


def _plain_int32_payload(weight: Any) -> QuantPayload:
    """``Int4PlainInt32Tensor`` (XPU): the qlens int4 layout, its bytes shared."""
    name = "Int4PlainInt32Tensor"
    group = _require_linear_weight(weight, name)
    if weight.zero_point.dtype != torch.int8:
        raise NotImplementedError(
            f"torchao {name} with {weight.zero_point.dtype} zero points is the Ascend NPU layout "
            "(torch_npu's npu_convert_weight_to_int4pack interleaves the codes in each int32), "
            f"which qlens does not read; {_OTHER_CONFIG}"
        )
    n, k = (int(s) for s in weight.shape)
    groups = ceil_div(k, group)
    scales = _per_row(weight.scale, n, groups, "scale", name)
    zeros = _per_row(weight.zero_point, n, groups, "zero_point", name)
    if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) > 15):
        raise ValueError(
            f"torchao {name} zero points must be 4-bit codes in [0, 15], got range "
            f"[{int(zeros.min())}, {int(zeros.max())}]"
        )
    symmetric = bool((zeros == midpoint(4)).all())
    # Four bytes per int32, byte i in bits 8i..8i+7 (little-endian): the bytes as written.
    data = weight.qdata.contiguous().view(torch.uint8)
    payload = QuantPayload(
        format=int_group_format(
            4,
            group,
            zero_point="none" if symmetric else "int",
            scale_dtype=SCALE_DTYPE_NAMES[scales.dtype],
        ),
        data=data,
        shape=(n, k),
        scales=scales,
        zeros=None if symmetric else zeros.to(torch.uint8),
        layout={"packing": "qlens", "source": f"torchao {name}"},
    )
    validate_int_group(payload)
    return payload


def _tile_packed_payload(weight: Any) -> QuantPayload:
    """``Int4TilePackedTo4dTensor``: codes read back through tinygemm, on its CUDA device."""
    name = "Int4TilePackedTo4dTensor"
    group = _require_linear_weight(weight, name)
    qdata, scale_and_zero = weight.qdata, weight.scale_and_zero
    if qdata.device.type != "cuda":
        raise NotImplementedError(
            f"torchao {name} holds tinygemm's CUDA tensor-core tiles, which qlens reads back "
            f"through tinygemm's own CUDA kernel; the weight is on {qdata.device}. Adopt it on a "
            f"CUDA device (model.to('cuda') first), or {_OTHER_CONFIG}"
        )
    n, k = (int(s) for s in weight.shape)
    padded_k = int(qdata.shape[1]) * 16 * 2 * int(qdata.shape[3])  # k-tiles of 16, 2 per int32
    padded_n = int(qdata.shape[0]) * 8
    if tuple(scale_and_zero.shape) != (ceil_div(padded_k, group), padded_n, 2):
        raise ValueError(
            f"torchao {name} scale_and_zero has shape {list(scale_and_zero.shape)}, expected "
            f"{[ceil_div(padded_k, group), padded_n, 2]} for its qdata"
        )
    unit = torch.zeros_like(scale_and_zero)
    unit[..., 0] = 1.0  # scale 1, zero point 0: the kernel returns q - 8
    device = qdata.device
    codes = torch.empty((n, k), dtype=torch.uint8, device=device)
    for start in range(0, k, _UNPACK_ROWS):
        rows = min(_UNPACK_ROWS, k - start)
        eye = torch.zeros((rows, padded_k), dtype=torch.bfloat16, device=device)
        eye[torch.arange(rows, device=device), torch.arange(start, start + rows, device=device)] = 1
        out = torch.ops.aten._weight_int4pack_mm(eye, qdata, group, unit)
        codes[:, start : start + rows] = (out[:, :n].t().float() + midpoint(4)).to(torch.uint8)
    groups = ceil_div(k, group)
    return pack_int4_float_zero(
        codes,
        scale_and_zero[:groups, :n, 0].t().contiguous(),
        scale_and_zero[:groups, :n, 1].t().contiguous(),
        group_size=group,
        source=f"torchao {name}",
    )


@register_adopter(
    "torchao int4 weights (Int4WeightOnlyConfig): Int4Tensor, Int4PlainInt32Tensor (XPU), "
    "Int4TilePackedTo4dTensor (on CUDA); Int4PreshuffledTensor is refused",
    lambda module: _int4_class(module) is not None,
)
def adopt_torchao_int4(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    name = _int4_class(module)
    if name == "Int4Tensor":
        return _plain_payload(weight)
    if name == "Int4PlainInt32Tensor":
        return _plain_int32_payload(weight)
    if name == "Int4TilePackedTo4dTensor":
        return _tile_packed_payload(weight)
    raise NotImplementedError(
        f"torchao {name} holds mslk's preshuffled int4 bytes (reordered for Hopper WGMMA loads, "
        f"with no documented layout), which qlens does not read; {_OTHER_CONFIG}"
    )
