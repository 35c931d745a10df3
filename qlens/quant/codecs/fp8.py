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
from qlens.quant.codecs.codec import Codec, QuantizeOptions
from qlens.quant.codecs.elements import (
    E4M3_MAX,
    as_e8m0_bytes,
    decode_e8m0,
    encode_e4m3,
    encode_e8m0,
)
from qlens.quant.codecs.grid import expand_blocks
from qlens.quant.codecs.registry import register_codec
from qlens.quant.codecs.rounding import round_scale_up
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


def dequantize_fp8_block(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """``W[n, k] = float(q[n, k]) * S[n // bn, k // bk]`` in fp32, then cast to ``dtype``."""
    validate_fp8_block(payload)
    return (payload.data.float() * fp8_block_element_scales(payload)).to(dtype)


def fp8_block_element_scales(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """The block multiplier of every element, float32 ``[*e, N, K]``."""
    _, n, k = weight_dims(payload)
    return expand_blocks(fp8_block_scale_grid(payload), payload.format.block, n, k)


def quantize_fp8_block(w: Float[Tensor, "*e n k"], options: QuantizeOptions) -> QuantPayload:
    """Round to nearest e4m3 with one amax/448 scale per block (default 128x128); E8M0 scales
    (``scale_dtype="e8m0"``) are rounded up to powers of two."""
    if options.group_size is not None:
        raise ValueError("fp8-block takes block_size=(rows, cols), not group_size")
    size = (128, 128) if options.block_size is None else options.block_size
    block = (size, size) if isinstance(size, int) else size
    scale_dtype = options.scale_dtype
    if scale_dtype not in (None, "fp32", "e8m0"):
        raise ValueError(f"fp8-block scale_dtype must be 'fp32' or 'e8m0', got {scale_dtype!r}")
    bn, bk = int(block[0]), int(block[1])
    *_, n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [*e, gn, bn, gk, bk]
    amax = tiles.abs().amax(dim=(-3, -1))
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # amax/448 as in transformers and DeepSeek; only where it falls into (or below) the fp32
    # subnormal range is it rounded up, so that a tiny nonzero block never gets a zero scale.
    tiny = scales < torch.finfo(torch.float32).tiny
    scales = torch.where(tiny, round_scale_up(amax.double() / E4M3_MAX, torch.float32), scales)
    if scale_dtype == "e8m0":
        # Round up to a power of two: 2**ceil(log2 s) never makes |W / s| exceed 448.
        mantissa, exponent = torch.frexp(scales)
        ceil_log2 = exponent.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
        stored: Tensor = encode_e8m0(ceil_log2)
        scales = torch.ldexp(torch.ones_like(scales), stored.to(torch.int32) - 127)
    else:
        stored = scales
    data = encode_e4m3(w / expand_blocks(scales, (bn, bk), n, k))
    return pack_fp8_block(data, stored, block=(bn, bk))


FP8_BLOCK_CODEC = register_codec(
    Codec(
        "fp8_block",
        dequantize_fp8_block,
        validate=validate_fp8_block,
        quantize=quantize_fp8_block,
        scheme="fp8-block",
        scheme_description="FP8 e4m3, one fp32 scale (amax/448) per 128x128 block; "
        "scale_dtype='e8m0' rounds the scales up to powers of two",
        quantize_options=("block_size", "scale_dtype"),
        element_scales=fp8_block_element_scales,
    )
)
