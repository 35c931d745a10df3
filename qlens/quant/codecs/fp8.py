"""Block FP8: e4m3 weights with one fp32 or E8M0 multiplier per (rows, cols) block."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.checks import (
    ceil_div,
    check_scales,
    require_dtype,
    require_same_device,
    require_shape,
    weight_dims,
)
from qlens.quant.codecs.elements import as_e8m0_bytes, decode_e8m0
from qlens.quant.codecs.grid import expand_blocks
from qlens.quant.codecs.registry import register_dequantizer
from qlens.quant.formats import fp8_block_format
from qlens.quant.payload import QuantPayload

E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def pack_fp8_block(
    data: Tensor,
    scales: Tensor,
    *,
    block: tuple[int, int] = (128, 128),
    layout: dict[str, object] | None = None,
) -> QuantPayload:
    """A validated ``fp8_block`` payload from e4m3 ``data [*e, N, K]`` and its block ``scales``.

    fp32 scales make an fp32-scaled format; ``uint8`` or ``float8_e8m0fnu`` scales an E8M0 one
    (stored as uint8 bytes). ``scales`` has shape ``[*e, ceil(N/bn), ceil(K/bk)]``.
    """
    scale_dtype = "e8m0" if scales.dtype in E8M0_DTYPES else "fp32"
    payload = QuantPayload(
        format=fp8_block_format(block, scale_dtype),
        data=data,
        shape=tuple(data.shape),
        scales=as_e8m0_bytes(scales),
        layout={"packing": "qlens", **(layout or {})},
    )
    validate_fp8_block(payload)
    return payload


def validate_fp8_block(payload: QuantPayload) -> None:
    """Raise a ValueError naming the first inconsistent tensor of an ``fp8_block`` payload."""
    require_same_device(payload)
    lead, n, k = weight_dims(payload)
    require_dtype(payload.data, "data", (torch.float8_e4m3fn,), payload)
    require_shape(payload.data, "data", payload.shape, payload)
    bn, bk = payload.format.block
    dtypes = E8M0_DTYPES if payload.format.scale_dtype == "e8m0" else (torch.float32,)
    check_scales(payload, (*lead, ceil_div(n, bn), ceil_div(k, bk)), dtypes)


def fp8_block_scale_grid(payload: QuantPayload) -> Float[Tensor, "*e gn gk"]:
    """The block multipliers as float32, ``[*e, ceil(N/bn), ceil(K/bk)]``."""
    assert payload.scales is not None
    if payload.format.scale_dtype == "e8m0":
        return decode_e8m0(as_e8m0_bytes(payload.scales))
    return payload.scales.float()


@register_dequantizer("fp8_block")
def dequantize_fp8_block(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """``W[n, k] = float(q[n, k]) * S[n // bn, k // bk]`` in fp32, then cast to ``dtype``."""
    validate_fp8_block(payload)
    _, n, k = weight_dims(payload)
    scales = expand_blocks(fp8_block_scale_grid(payload), payload.format.block, n, k)
    return (payload.data.float() * scales).to(dtype)
