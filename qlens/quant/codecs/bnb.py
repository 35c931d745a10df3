"""bitsandbytes weights: 4-bit NF4/FP4 (with or without nested absmax) and LLM.int8.

4-bit payloads keep bitsandbytes' own layout: ``data`` is the row-major flattened weight, two
codes per byte, HIGH nibble first (element ``2j`` in bits 4-7 of byte ``j``), shape
``[ceil(N*K/2), 1]``. One absmax per ``blocksize`` consecutive flattened elements
(``format.block[1]``). ``extras["code"]`` is the 16-entry float32 quant map. When the absmax is
itself quantized (bitsandbytes "nested"/double quantization), ``scales`` is ``uint8`` and
``extras`` holds ``nested_absmax`` float32, ``nested_code`` float32 ``[256]`` and
``nested_offset`` float32 0-dim; ``layout["nested_blocksize"]`` is its block size (256).

LLM.int8 payloads: ``data`` int8 ``[N, K]``, ``scales`` float32 ``[N]`` (the row absmax ``SCB``);
``W = q * SCB / 127``, computed as bitsandbytes does (times the float32 reciprocal of 127).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
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

PACKING = "bitsandbytes"
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
INT8_RECIPROCAL = 7.874015718698502e-3  # bitsandbytes' float constant for 1/127
_FLOAT_OUTPUTS = (torch.float32, torch.bfloat16, torch.float16)


def bnb_4bit_format(quant_type: str, blocksize: int = 64) -> QuantFormat:
    """The :class:`QuantFormat` of a bitsandbytes 4-bit weight (``quant_type`` "nf4" or "fp4")."""
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"bitsandbytes quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if blocksize not in BNB_BLOCKSIZES:
        raise ValueError(f"bitsandbytes blocksize must be one of {BNB_BLOCKSIZES}, got {blocksize}")
    return QuantFormat(
        name=f"bnb_{quant_type}",
        element="nf4" if quant_type == "nf4" else "fp4_bnb",
        bits=4,
        block=(1, blocksize),
        scale_dtype="fp32",
        description=f"bitsandbytes {quant_type.upper()}, absmax per {blocksize} flattened elements",
    )


BNB_INT8 = QuantFormat(
    name="bnb_int8",
    element="int8",
    bits=8,
    block=(1, 0),
    scale_dtype="fp32",
    description="bitsandbytes LLM.int8: int8 weight, per-row absmax SCB (W = q * SCB / 127)",
)


def _check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in _FLOAT_OUTPUTS:
        raise ValueError(
            f"bitsandbytes weights dequantize to float32/bfloat16/float16, not {dtype}"
        )


def _checked(
    payload: QuantPayload, name: str, value: Tensor | None, dtype: torch.dtype, shape: tuple
) -> Tensor:
    """``value`` after checking presence, dtype, shape and (for floats) finiteness."""
    tensor = require_tensor(value, name, payload)
    require_dtype(tensor, name, (dtype,), payload)
    require_shape(tensor, name, shape, payload)
    if tensor.is_floating_point():
        require_finite(tensor, name, payload)
    return tensor


def block_absmax(payload: QuantPayload, n_blocks: int) -> Float[Tensor, " blocks"]:
    """Absmax per block, decoding bitsandbytes' nested (double) quantization when present."""
    if payload.scales is not None and payload.scales.dtype == torch.float32:
        return _checked(payload, "scales", payload.scales, torch.float32, (n_blocks,))
    codes = _checked(payload, "scales", payload.scales, torch.uint8, (n_blocks,))
    nested_blocksize = payload.layout.get("nested_blocksize")
    if not isinstance(nested_blocksize, int) or nested_blocksize <= 0:
        raise ValueError(
            "a nested bitsandbytes payload (uint8 scales) needs layout['nested_blocksize'] "
            f"(a positive int), got {nested_blocksize!r}"
        )
    extras = payload.extras
    n_nested = ceil_div(n_blocks, nested_blocksize)
    nested_absmax = _checked(
        payload, "extra.nested_absmax", extras.get("nested_absmax"), torch.float32, (n_nested,)
    )
    nested_code = _checked(
        payload, "extra.nested_code", extras.get("nested_code"), torch.float32, (256,)
    )
    offset = _checked(
        payload, "extra.nested_offset", extras.get("nested_offset"), torch.float32, ()
    )
    values = nested_code[codes.long()]
    scale = nested_absmax.repeat_interleave(nested_blocksize)[:n_blocks]
    return values * scale + offset


@register_dequantizer("bnb_nf4", "bnb_fp4")
def dequantize_bnb_4bit(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "..."]:
    """Reconstruct a bitsandbytes NF4/FP4 weight exactly as ``bitsandbytes.functional`` does."""
    _check_output_dtype(dtype)
    numel = payload.numel
    blocksize = payload.format.block[1]
    if blocksize not in BNB_BLOCKSIZES:
        raise ValueError(f"bitsandbytes blocksize must be one of {BNB_BLOCKSIZES}, got {blocksize}")
    require_same_device(payload)
    packed = _checked(payload, "data", payload.data, torch.uint8, (ceil_div(numel, 2), 1))
    code = _checked(payload, "extra.code", payload.extras.get("code"), torch.float32, (16,))
    n_blocks = ceil_div(numel, blocksize)
    absmax = block_absmax(payload, n_blocks)
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(-1)[:numel]
    values = code[nibbles.long()]
    scale = absmax.repeat_interleave(blocksize)[:numel]
    return (values * scale).reshape(payload.shape).to(dtype)


@register_dequantizer("bnb_int8")
def dequantize_bnb_int8(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "out in"]:
    """Reconstruct an LLM.int8 weight: ``q * SCB[:, None] / 127`` in bitsandbytes' order."""
    _check_output_dtype(dtype)
    if len(payload.shape) != 2:
        raise ValueError(f"bnb_int8 payload shape must be [out, in], got {list(payload.shape)}")
    require_same_device(payload)
    q = _checked(payload, "data", payload.data, torch.int8, tuple(payload.shape))
    scb = _checked(payload, "scales", payload.scales, torch.float32, (payload.shape[0],))
    return (q * scb.reshape(-1, 1) * INT8_RECIPROCAL).to(dtype)
