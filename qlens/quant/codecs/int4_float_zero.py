"""Int4 codes with a float zero point, as torchao's int4 tensors store them: ``W = q * s + z``.

Layout (``layout["packing"] == "torchao"``, format ``int4`` with ``zero_point == "float"``) of one
``[N, K]`` weight cut into groups of ``g`` consecutive columns along K:

- ``data uint8 [N, ceil(K/2)]``: signed (two's-complement) 4-bit codes ``q`` in ``[-8, 7]``, two
  per byte, low nibble = even k (torchao ``Int4Tensor.qdata``, packed by mslk's ``pack_int4``);
- ``scales [N, ceil(K/g)]`` and ``zeros [N, ceil(K/g)]``, fp32, bf16 or fp16, one dtype (torchao
  stores both transposed, ``[K/g, N]``);
- ``W = q * s + z`` in float32: the product is exact, the sum rounds once. This is torchao's
  float-zero-point dequantization (``_dequantize_affine_tinygemm`` to float32), which computes
  ``(u - 8) * s + z`` for the unsigned code ``u = q + 8`` (tinygemm's convention).

qlens' Triton kernels do not read this packing (a float zero point is no integer zero point), so
a linear with such a weight dequantizes, then multiplies.
"""

from __future__ import annotations

import dataclasses

import torch
from jaxtyping import Float, Integer, UInt8
from torch import Tensor

from qlens.quant.codecs.bits import pack_nibbles, unpack_nibbles
from qlens.quant.codecs.checks import (
    ceil_div,
    check_scales,
    require_contiguous,
    require_dtype,
    require_finite,
    require_same_device,
    require_shape,
    require_tensor,
    weight_dims,
)
from qlens.quant.codecs.grid import expand_groups
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES
from qlens.quant.formats import QuantFormat, int_group_format
from qlens.quant.payload import QuantPayload

PACKING = "torchao"


def int4_float_zero_format(group_size: int, scale_dtype: torch.dtype) -> QuantFormat:
    """``int4`` with one ``scale_dtype`` scale and float zero point per ``group_size`` along K."""
    name = SCALE_DTYPE_NAMES[scale_dtype]
    fmt = int_group_format(4, group_size, zero_point="float", scale_dtype=name)
    return dataclasses.replace(
        fmt,
        description=f"INT4 signed codes with a float zero point, W = q * s + z in fp32, one "
        f"{name} scale and zero point per {group_size} along K (torchao)",
    )


def int4_float_zero_payload(
    data: UInt8[Tensor, "n half"],
    shape: tuple[int, int],
    scales: Float[Tensor, "n groups"],
    zeros: Float[Tensor, "n groups"],
    *,
    group_size: int,
    source: str,
) -> QuantPayload:
    """A validated payload around already packed signed nibbles ``data`` (shared, not copied)."""
    require_dtype(scales, "scales", tuple(SCALE_DTYPE_NAMES))
    payload = QuantPayload(
        format=int4_float_zero_format(group_size, scales.dtype),
        data=data,
        shape=(int(shape[0]), int(shape[1])),
        scales=scales,
        zeros=zeros,
        layout={"packing": PACKING, "source": source},
    )
    validate_int4_float_zero(payload)
    return payload


def pack_int4_float_zero(
    codes: Integer[Tensor, "n k"],
    scales: Float[Tensor, "n groups"],
    zeros: Float[Tensor, "n groups"],
    *,
    group_size: int,
    source: str,
) -> QuantPayload:
    """The payload of unsigned codes ``u`` in ``[0, 16)`` meaning ``W = (u - 8) * s + z``."""
    codes = codes.long()
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(
            f"`codes` must be unsigned 4-bit values in [0, 16), got range "
            f"[{int(codes.min())}, {int(codes.max())}]"
        )
    signed_nibbles = (codes ^ 8).to(
        torch.uint8
    )  # u - 8 in two's complement is u with bit 3 flipped
    n, k = (int(s) for s in codes.shape)
    return int4_float_zero_payload(
        pack_nibbles(signed_nibbles).contiguous(), (n, k), scales, zeros,
        group_size=group_size, source=source,
    )  # fmt: skip


def validate_int4_float_zero(payload: QuantPayload) -> None:
    """Raise a ValueError naming the first inconsistent tensor of a float-zero int4 payload."""
    require_same_device(payload)
    fmt = payload.format
    if fmt.name != "int4" or fmt.zero_point != "float":
        raise ValueError(
            f"the {PACKING!r} packing holds int4 codes with a float zero point, got a {fmt.name} "
            f"format with zero_point={fmt.zero_point!r}"
        )
    lead, n, k = weight_dims(payload)
    if lead:
        raise ValueError(
            f"int4 {PACKING!r} payload must be one [out, in] weight, got shape "
            f"{list(payload.shape)}"
        )
    require_dtype(payload.data, "data", (torch.uint8,), payload)
    require_shape(payload.data, "data", (n, ceil_div(k, 2)), payload,
                  fix="int4 packs two codes per byte along K")  # fmt: skip
    require_contiguous(payload.data, "data", payload)
    scales = check_scales(payload, (n, ceil_div(k, fmt.block[1])), tuple(SCALE_DTYPE_NAMES))
    if SCALE_DTYPE_NAMES[scales.dtype] != fmt.scale_dtype:
        raise ValueError(
            f"int4 payload `scales` are {scales.dtype} but the format says "
            f"scale_dtype={fmt.scale_dtype!r}; build the payload with int4_float_zero_payload"
        )
    zeros = require_tensor(
        payload.zeros, "zeros", payload, "provide one float zero point per group"
    )
    require_shape(zeros, "zeros", scales.shape, payload)
    require_dtype(zeros, "zeros", (scales.dtype,), payload,
                  fix="the zero points are stored in the scales' dtype")  # fmt: skip
    require_finite(zeros, "zeros", payload)


def signed_codes(payload: QuantPayload) -> Integer[Tensor, "n k"]:
    """The codes ``q`` in ``[-8, 7]``, ``[N, K]`` int8."""
    k = int(payload.shape[-1])
    nibbles = unpack_nibbles(payload.data, k).to(torch.int8)
    return nibbles - ((nibbles & 8) << 1)


def dequantize_int4_float_zero(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "n k"]:
    """``q * s + z`` in float32, cast to ``dtype``."""
    validate_int4_float_zero(payload)
    k = int(payload.shape[-1])
    group = payload.format.block[1]
    scales = require_tensor(payload.scales, "scales", payload)
    zeros = require_tensor(payload.zeros, "zeros", payload)
    weight = signed_codes(payload).float() * expand_groups(scales.float(), group, k)
    weight += expand_groups(zeros.float(), group, k)
    return weight.to(dtype)
