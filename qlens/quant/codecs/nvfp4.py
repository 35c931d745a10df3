"""NVFP4: e2m1 codes two per byte, one e4m3 scale per 16 along K, and an fp32 global scale.

Two conventions for the global: "multiply" (ModelOpt ``weight_scale_2``, torchao
``per_tensor_scale``, qlens' quantizer): ``W = fp4 * (s * g)``; "divide" (compressed-tensors
``weight_global_scale``): ``W = fp4 * (s / g)``. Scales are row-major or SWIZZLE_32_4_4.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.bits import pack_nibbles, unpack_nibbles
from qlens.quant.codecs.checks import (
    ceil_div,
    check_scales,
    require_contiguous,
    require_dtype,
    require_finite,
    require_layout,
    require_same_device,
    require_shape,
    require_tensor,
    weight_dims,
)
from qlens.quant.codecs.codec import Codec, QuantizeOptions
from qlens.quant.codecs.elements import E2M1_MAX, E4M3_MAX, decode_e2m1, encode_e2m1
from qlens.quant.codecs.grid import expand_groups
from qlens.quant.codecs.registry import register_codec
from qlens.quant.codecs.rounding import E4M3_SMALLEST_NORMAL, group_view
from qlens.quant.codecs.swizzle import SWIZZLE_32_4_4, swizzled_shape, unswizzle_32_4_4
from qlens.quant.formats import nvfp4_format
from qlens.quant.payload import QuantPayload

NV_BLOCK = 16


def pack_nvfp4(
    data: Tensor,
    scales: Tensor,
    global_scale: Tensor,
    shape: tuple[int, ...],
    *,
    global_convention: str = "multiply",
    layout: dict[str, object] | None = None,
) -> QuantPayload:
    """A validated NVFP4 payload.

    ``data`` uint8 ``[*e, N, ceil(K/16)*8]`` (low nibble first), ``scales`` float8_e4m3fn
    ``[*e, N, ceil(K/16)]`` (or a SWIZZLE_32_4_4 container with
    ``layout={"scale_swizzle": "32_4_4"}``), ``global_scale`` fp32 (0-dim, ``[1]`` or one per
    expert ``[*e]``).
    """
    payload = QuantPayload(
        format=nvfp4_format(global_convention),
        data=data,
        shape=tuple(int(s) for s in shape),
        scales=scales,
        global_scale=global_scale,
        layout={"packing": "qlens", **(layout or {})},
    )
    validate_nvfp4(payload)
    return payload


def validate_nvfp4(payload: QuantPayload) -> None:
    """Raise a ValueError naming the first inconsistent tensor of an NVFP4 payload."""
    require_same_device(payload)
    lead, n, k = weight_dims(payload)
    groups = ceil_div(k, NV_BLOCK)
    require_dtype(payload.data, "data", (torch.uint8,), payload)
    require_shape(
        payload.data,
        "data",
        (*lead, n, groups * NV_BLOCK // 2),
        payload,
        fix="NVFP4 packs two codes per byte, K padded to a multiple of 16",
    )
    require_contiguous(payload.data, "data", payload)
    swizzle = require_layout(payload, "scale_swizzle", ("none", SWIZZLE_32_4_4))
    grid = swizzled_shape(n, groups) if swizzle == SWIZZLE_32_4_4 else (n, groups)
    check_scales(payload, (*lead, *grid), (torch.float8_e4m3fn,))
    g = require_tensor(payload.global_scale, "global_scale", payload, "pass the fp32 global scale")
    require_dtype(g, "global_scale", (torch.float32,), payload)
    if tuple(g.shape) not in ((), (1,), tuple(lead)):
        raise ValueError(
            f"nvfp4 payload `global_scale` must have shape [], [1] or the expert dims "
            f"{list(lead)}, got {list(g.shape)}"
        )
    require_finite(g, "global_scale", payload)
    if payload.format.global_scale == "divide" and bool((g == 0).any()):
        raise ValueError(
            "nvfp4 payload `global_scale` is 0 under the 'divide' convention (W = fp4*s/g); "
            "a compressed-tensors global is 448*6/amax and never 0: check the convention"
        )


def nvfp4_scales(payload: QuantPayload) -> Float[Tensor, "*e n g"]:
    """Effective float32 per-block multipliers ``s * g`` or ``s / g``, ``[*e, N, ceil(K/16)]``."""
    _, n, k = weight_dims(payload)
    assert payload.scales is not None and payload.global_scale is not None
    scales = payload.scales
    if payload.layout.get("scale_swizzle", "none") == SWIZZLE_32_4_4:
        scales = unswizzle_32_4_4(scales, n, ceil_div(k, NV_BLOCK))
    g = payload.global_scale
    g = g.reshape(()) if g.numel() == 1 else g.reshape(*g.shape, 1, 1)
    if payload.format.global_scale == "divide":
        return scales.float() / g
    return g * scales.float()


def nvfp4_element_scales(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """The effective multiplier (block scale and global) of every element, ``[*e, N, K]``."""
    _, _, k = weight_dims(payload)
    return expand_groups(nvfp4_scales(payload), NV_BLOCK, k)


def dequantize_nvfp4(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """``W = fp4 * (s * g)`` (multiply) or ``fp4 * (s / g)`` (divide) in fp32, cast to ``dtype``."""
    validate_nvfp4(payload)
    _, _, k = weight_dims(payload)
    values = decode_e2m1(unpack_nibbles(payload.data, k))
    return (values * nvfp4_element_scales(payload)).to(dtype)


def quantize_nvfp4(w: Float[Tensor, "*e n k"], options: QuantizeOptions) -> QuantPayload:
    """Round to nearest e2m1 with an e4m3 scale per 16 along K and one fp32 global
    ``amax / (6 * 448)`` (multiply convention)."""
    if options.group_size not in (None, NV_BLOCK):
        raise ValueError(
            f"nvfp4 uses a fixed group of {NV_BLOCK}, got group_size={options.group_size}"
        )
    if options.scale_dtype not in (None, "e4m3"):
        raise ValueError(f"nvfp4 scales are e4m3, got scale_dtype={options.scale_dtype!r}")
    *lead, n, k = w.shape
    amax = w.abs().amax()
    g = amax / (E4M3_MAX * E2M1_MAX) if bool(amax > 0) else torch.ones((), device=w.device)
    groups = group_view(w, NV_BLOCK)
    block_scale = groups.abs().amax(dim=-1) / E2M1_MAX
    scales = (block_scale / g).clamp(E4M3_SMALLEST_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / g) / scales.float()
    scaled = (groups * reciprocal.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    data = pack_nibbles(encode_e2m1(scaled.flatten(-2)))
    return pack_nvfp4(data, scales, g.reshape(()).float(), (*lead, n, k))


NVFP4_CODEC = register_codec(
    Codec(
        "nvfp4",
        dequantize_nvfp4,
        validate=validate_nvfp4,
        quantize=quantize_nvfp4,
        scheme_description="NVFP4: e2m1 two per byte, e4m3 scale per 16 along K, fp32 global "
        "amax/(6*448) (multiply convention)",
        quantize_options=("scale_dtype",),
        element_scales=nvfp4_element_scales,
    )
)
