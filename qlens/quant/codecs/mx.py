"""OCP MX formats: MXFP8 (e4m3) and MXFP4 (e2m1, two per byte) with one E8M0 scale per 32 along K.

Also reads and writes the GPT-OSS expert layout ``*_blocks [E, N, K/32, 16]`` /
``*_scales [E, N, K/32]``, which is the qlens MXFP4 layout with the K axis split in blocks.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, UInt8
from torch import Tensor

from qlens.quant.codecs.bits import pack_nibbles, unpack_nibbles
from qlens.quant.codecs.checks import (
    ceil_div,
    check_scales,
    require_contiguous,
    require_dtype,
    require_layout,
    require_same_device,
    require_shape,
    weight_dims,
)
from qlens.quant.codecs.codec import Codec, QuantizeOptions
from qlens.quant.codecs.elements import (
    E2M1_MAX,
    ELEMENT_EMAX,
    as_e8m0_bytes,
    decode_e2m1,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
)
from qlens.quant.codecs.grid import expand_groups
from qlens.quant.codecs.registry import register_codec
from qlens.quant.codecs.rounding import group_view, pow2_exponent_floor
from qlens.quant.codecs.swizzle import SWIZZLE_32_4_4, swizzled_shape, unswizzle_32_4_4
from qlens.quant.formats import MXFP4, MXFP8
from qlens.quant.payload import QuantPayload

MX_BLOCK = 32
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def pack_mx(
    data: Tensor,
    scales: Tensor,
    shape: tuple[int, ...],
    *,
    layout: dict[str, object] | None = None,
) -> QuantPayload:
    """A validated MX payload: e4m3 ``data`` makes MXFP8, packed uint8 ``data`` MXFP4.

    ``scales`` are E8M0 (``uint8`` or ``float8_e8m0fnu``), ``[*e, N, ceil(K/32)]`` or, with
    ``layout={"scale_swizzle": "32_4_4"}``, a SWIZZLE_32_4_4 container.
    """
    fmt = MXFP8 if data.dtype == torch.float8_e4m3fn else MXFP4
    payload = QuantPayload(
        format=fmt,
        data=data,
        shape=tuple(int(s) for s in shape),
        scales=as_e8m0_bytes(scales),
        layout={"packing": "qlens", **(layout or {})},
    )
    validate_mx(payload)
    return payload


def validate_mx(payload: QuantPayload) -> None:
    """Raise a ValueError naming the first inconsistent tensor of an MXFP8/MXFP4 payload."""
    require_same_device(payload)
    lead, n, k = weight_dims(payload)
    groups = ceil_div(k, MX_BLOCK)
    if payload.format.name == "mxfp8":
        require_dtype(payload.data, "data", (torch.float8_e4m3fn,), payload)
        require_shape(payload.data, "data", payload.shape, payload)
    else:
        require_dtype(payload.data, "data", (torch.uint8,), payload)
        require_shape(
            payload.data,
            "data",
            (*lead, n, groups * MX_BLOCK // 2),
            payload,
            fix="MXFP4 packs two codes per byte, K padded to a multiple of 32",
        )
        require_contiguous(payload.data, "data", payload)
    swizzle = require_layout(payload, "scale_swizzle", ("none", SWIZZLE_32_4_4))
    grid = swizzled_shape(n, groups) if swizzle == SWIZZLE_32_4_4 else (n, groups)
    check_scales(payload, (*lead, *grid), E8M0_DTYPES)


def mx_scales(payload: QuantPayload) -> Float[Tensor, "*e n g"]:
    """Decoded float32 scales ``[*e, N, ceil(K/32)]`` (unswizzled if needed)."""
    _, n, k = weight_dims(payload)
    assert payload.scales is not None
    scale_bytes = as_e8m0_bytes(payload.scales)
    if payload.layout.get("scale_swizzle", "none") == SWIZZLE_32_4_4:
        scale_bytes = unswizzle_32_4_4(scale_bytes, n, ceil_div(k, MX_BLOCK))
    return decode_e8m0(scale_bytes)


def mx_elements(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """The unscaled element values (e4m3 or e2m1) as float32 ``[*e, N, K]``."""
    _, _, k = weight_dims(payload)
    if payload.format.name == "mxfp8":
        return payload.data.float()
    return decode_e2m1(unpack_nibbles(payload.data, k))


def mx_element_scales(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """The E8M0 multiplier of every element, float32 ``[*e, N, K]``."""
    _, _, k = weight_dims(payload)
    return expand_groups(mx_scales(payload), MX_BLOCK, k)


def dequantize_mx(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """``W = element * 2**(e - 127)`` in fp32, then cast to ``dtype``."""
    validate_mx(payload)
    return (mx_elements(payload) * mx_element_scales(payload)).to(dtype)


def quantize_mx(w: Float[Tensor, "*e n k"], options: QuantizeOptions) -> QuantPayload:
    """OCP MX round to nearest: one E8M0 scale ``2**(floor(log2 amax) - emax)`` per 32 along K,
    e4m3 elements for "mxfp8", e2m1 (saturating at 6) for "mxfp4"."""
    scheme = options.scheme
    if options.group_size not in (None, MX_BLOCK):
        raise ValueError(
            f"{scheme} uses a fixed group of {MX_BLOCK}, got group_size={options.group_size}"
        )
    if options.scale_dtype not in (None, "e8m0"):
        raise ValueError(f"{scheme} scales are e8m0, got scale_dtype={options.scale_dtype!r}")
    element = "e4m3" if scheme == "mxfp8" else "e2m1"
    *lead, n, k = w.shape
    groups = group_view(w, MX_BLOCK)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(
        amax > 0,
        pow2_exponent_floor(amax) - ELEMENT_EMAX[element],
        torch.full_like(amax, -127, dtype=torch.int32),
    )
    scale_bytes = encode_e8m0(exponent)
    scale = torch.ldexp(torch.ones_like(amax), scale_bytes.to(torch.int32) - 127)
    scaled = groups / scale.unsqueeze(-1)
    if element == "e4m3":
        data = encode_e4m3(scaled.flatten(-2)[..., :k])
    else:
        data = pack_nibbles(encode_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)))
    return pack_mx(data, scale_bytes, (*lead, n, k))


MXFP8_CODEC, MXFP4_CODEC = (
    register_codec(
        Codec(
            fmt.name,
            dequantize_mx,
            validate=validate_mx,
            quantize=quantize_mx,
            scheme_description=description,
            quantize_options=("scale_dtype",),
            element_scales=mx_element_scales,
        )
    )
    for fmt, description in (
        (MXFP8, "OCP MXFP8: e4m3, one E8M0 scale per 32 along K (e = floor(log2 amax) - 8)"),
        (
            MXFP4,
            "OCP MXFP4: e2m1 two per byte, one E8M0 scale per 32 along K "
            "(e = floor(log2 amax) - 2)",
        ),
    )
)


def mxfp4_from_gpt_oss(
    blocks: UInt8[Tensor, "*e n g 16"], scales: UInt8[Tensor, "*e n g"]
) -> QuantPayload:
    """MXFP4 payload from GPT-OSS ``*_blocks`` / ``*_scales`` (checkpoint layout, ``[E, out, ...]``).

    The logical weight is ``[E, out, in]`` with ``in = 32 * g``; note that HF's dequantized
    ``GptOssExperts`` tensors are the transpose, ``[E, in, out]``.
    """
    if blocks.dim() < 3 or blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(
            f"GPT-OSS `blocks` must have shape [*experts, out, in/32, 16], got {list(blocks.shape)}"
        )
    require_shape(scales, "scales", blocks.shape[:-1], fix="scales are [*experts, out, in/32]")
    data = blocks.contiguous().flatten(-2)
    return pack_mx(data, scales, (*blocks.shape[:-3], blocks.shape[-3], data.shape[-1] * 2))


def mxfp4_to_gpt_oss(payload: QuantPayload) -> tuple[UInt8[Tensor, "*e n g 16"], Tensor]:
    """GPT-OSS ``(blocks [*e, N, K/32, 16], scales [*e, N, K/32])`` from a linear-scale MXFP4 payload."""
    validate_mx(payload)
    if payload.format.name != "mxfp4" or payload.layout.get("scale_swizzle", "none") != "none":
        raise ValueError(
            "only MXFP4 payloads with row-major scales map to the GPT-OSS layout, got "
            f"{payload.format.name} with layout {payload.layout}"
        )
    assert payload.scales is not None
    return payload.data.unflatten(-1, (-1, MX_BLOCK // 2)), payload.scales
