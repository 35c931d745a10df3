"""BitNet b1.58 ternary weights: 2 bits per weight, 4 per byte, packed along the output dim.

``data`` is ``uint8 [ceil(N/4), K]``: with ``R = ceil(N/4)``, bits ``[2i, 2i+1]`` of packed row
``r`` hold ``T[i*R + r] + 1`` (``T`` in {-1, 0, 1} stored as {0, 1, 2}), i.e. the rows are split in
four contiguous chunks. ``global_scale`` is the scalar ``weight_scale``; ``format.global_scale``
says how it applies: "divide" for transformers' ``BitLinear`` (``W = T / weight_scale``),
"multiply" for ``AutoBitLinear`` (``W = T * weight_scale``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Integer, UInt8
from torch import Tensor

from qlens.quant.codecs.checks import (
    ceil_div,
    require_dtype,
    require_finite,
    require_same_device,
    require_shape,
    require_tensor,
)
from qlens.quant.codecs.registry import register_dequantizer
from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

PACKING = "bitnet"
VALUES_PER_BYTE = 4


def bitnet_format(scale_convention: str) -> QuantFormat:
    """The BitNet :class:`QuantFormat`; ``scale_convention`` is "divide" or "multiply"."""
    if scale_convention not in ("divide", "multiply"):
        raise ValueError(
            f"BitNet weight_scale convention must be 'divide' (BitLinear) or 'multiply' "
            f"(AutoBitLinear), got {scale_convention!r}"
        )
    return QuantFormat(
        name="bitnet",
        element="ternary",
        bits=2,
        block=(0, 0),
        scale_dtype="none",
        global_scale=scale_convention,
        description=f"BitNet ternary, 4 per byte along out, weight_scale: {scale_convention}",
    )


def pack_ternary(
    ternary: Integer[Tensor, "out ..."] | Float[Tensor, "out ..."],
) -> UInt8[Tensor, "packed_out ..."]:
    """Pack values in {-1, 0, 1} four per byte along dim 0 (contiguous quarters)."""
    if ternary.ndim == 0:
        raise ValueError("pack_ternary needs at least one dimension")
    if not torch.isin(
        ternary, torch.tensor([-1, 0, 1], dtype=ternary.dtype, device=ternary.device)
    ).all():
        raise ValueError("BitNet weights must be ternary: every value in {-1, 0, 1}")
    n_rows = ternary.shape[0]
    chunk = ceil_div(n_rows, VALUES_PER_BYTE)
    stored = (ternary.to(torch.int16) + 1).to(torch.uint8)
    padded = torch.ones(
        (chunk * VALUES_PER_BYTE, *ternary.shape[1:]), dtype=torch.uint8, device=ternary.device
    )
    padded[:n_rows] = stored
    quarters = padded.reshape(VALUES_PER_BYTE, chunk, *ternary.shape[1:])
    packed = torch.zeros_like(quarters[0])
    for i in range(VALUES_PER_BYTE):
        packed |= quarters[i] << (2 * i)
    return packed


def unpack_ternary(
    packed: UInt8[Tensor, "packed_out ..."], n_rows: int
) -> Integer[Tensor, "out ..."]:
    """Inverse of :func:`pack_ternary`: int8 values in {-1, 0, 1}, the first ``n_rows`` rows."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"BitNet packed weights must be torch.uint8, got {packed.dtype}")
    if packed.ndim == 0 or ceil_div(n_rows, VALUES_PER_BYTE) != packed.shape[0]:
        raise ValueError(
            f"BitNet data for {n_rows} rows must have {ceil_div(n_rows, VALUES_PER_BYTE)} packed "
            "rows, "
            f"got shape {list(packed.shape)}"
        )
    quarters = [(packed >> (2 * i)) & 3 for i in range(VALUES_PER_BYTE)]
    stored = torch.cat(quarters, dim=0)[:n_rows]
    if (stored == 3).any():
        raise ValueError(
            "BitNet packed weights hold the invalid 2-bit code 3 (only 0, 1, 2 = -1, 0, 1)"
        )
    return stored.to(torch.int8) - 1


@register_dequantizer("bitnet")
def dequantize_bitnet(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "..."]:
    """Reconstruct ``T / weight_scale`` (BitLinear) or ``T * weight_scale`` (AutoBitLinear)."""
    if not dtype.is_floating_point:
        raise ValueError(f"BitNet weights dequantize to a float dtype, not {dtype}")
    scale = require_tensor(payload.global_scale, "global_scale", payload, "pass weight_scale")
    require_dtype(scale, "global_scale", (torch.float32, torch.bfloat16, torch.float16), payload)
    if scale.numel() != 1:
        raise ValueError(
            f"bitnet payload `global_scale` must be one scalar weight_scale, got shape "
            f"{list(scale.shape)}"
        )
    require_finite(scale, "global_scale", payload)
    if scale.item() == 0:
        raise ValueError("bitnet payload `global_scale` (weight_scale) is 0: the weight is corrupt")
    require_dtype(payload.data, "data", (torch.uint8,), payload)
    expected = (ceil_div(payload.shape[0], VALUES_PER_BYTE), *payload.shape[1:])
    require_shape(
        payload.data, "data", expected, payload, fix="4 ternary values per byte along out"
    )
    require_same_device(payload)
    ternary = unpack_ternary(payload.data, payload.shape[0]).to(torch.float32)
    s = scale.reshape(()).to(torch.float32)
    convention = payload.format.global_scale
    if convention == "divide":
        return (ternary / s).to(dtype)
    if convention == "multiply":
        return (ternary * s).to(dtype)
    raise ValueError(
        f"bitnet format.global_scale must be 'divide' or 'multiply', got {convention!r}"
    )
