"""Group-wise integer weights: the qlens int4/int8 layouts, decoding of every integer packing,
and exact repacking of GPTQ / AWQ / compressed-tensors payloads into the qlens layout.
optimum-quanto's packing (float shift) is ``qlens.quant.codecs.quanto_bits``, torchao's int4
with a float zero point ``qlens.quant.codecs.int4_float_zero``.

qlens layouts (``layout["packing"] == "qlens"``), one scale per ``g = format.block[1]`` along K:
- int4: ``data uint8 [*e, N, ceil(K/2)]`` low nibble = even k, codes 0..15; ``zeros`` None
  (symmetric, ``W = (q - 8) * s``) or ``uint8 [*e, N, G]`` (``W = (q - z) * s``).
- int8: ``data int8 [*e, N, K]``; ``zeros`` None (``W = q * s``) or ``int8 [*e, N, G]``.
Scales are fp32, bf16 or fp16 ``[*e, N, G]``.
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
    require_same_device,
    require_shape,
    require_tensor,
    weight_dims,
)
from qlens.quant.codecs.codec import Codec, QuantizeOptions
from qlens.quant.codecs.grid import expand_groups
from qlens.quant.codecs.intcodes import IntGroups, contiguous_group_index, midpoint
from qlens.quant.codecs.intpackings import (
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)
from qlens.quant.codecs.registry import register_codec
from qlens.quant.codecs.rounding import group_view, round_scale_up
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload

SCALE_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
QLENS_INT_BITS = (4, 8)
_UNPACKERS = {
    "gptq": unpack_gptq,
    "awq": unpack_awq,
    "compressed-tensors": unpack_compressed_tensors,
}


def pack_int_group(
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor | None = None,
    *,
    bits: int,
    group_size: int,
) -> QuantPayload:
    """A validated qlens int4/int8 payload from unsigned codes ``[*e, N, K]`` in ``[0, 2**bits)``.

    ``zeros`` (unsigned code units, ``[*e, N, G]``) or None for symmetric (zero ``2**(bits-1)``).
    ``W = (codes - zeros) * scales``.
    """
    if bits not in QLENS_INT_BITS:
        raise ValueError(f"qlens int layouts support bits {QLENS_INT_BITS}, got {bits}")
    require_dtype(scales, "scales", tuple(SCALE_DTYPE_NAMES))
    codes = codes.long()
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(
            f"`codes` must be unsigned {bits}-bit values in [0, {1 << bits}), got range "
            f"[{int(codes.min())}, {int(codes.max())}]"
        )
    if bits == 4:
        data = pack_nibbles(codes.to(torch.uint8))
        stored_zeros = None if zeros is None else _to_code_dtype(zeros, torch.uint8, 0, 255)
    else:
        data = (codes - 128).to(torch.int8)
        stored_zeros = None if zeros is None else _to_code_dtype(zeros - 128, torch.int8, -128, 127)
    fmt = int_group_format(
        bits,
        group_size,
        zero_point="none" if zeros is None else "int",
        scale_dtype=SCALE_DTYPE_NAMES[scales.dtype],
    )
    payload = QuantPayload(
        format=fmt,
        data=data.contiguous(),
        shape=tuple(codes.shape),
        scales=scales,
        zeros=stored_zeros,
        layout={"packing": "qlens"},
    )
    validate_int_group(payload)
    return payload


def _to_code_dtype(values: Tensor, dtype: torch.dtype, low: int, high: int) -> Tensor:
    values = values.long()
    if values.numel() and (int(values.min()) < low or int(values.max()) > high):
        raise ValueError(
            f"zero points must fit {dtype} ([{low}, {high}]) in the qlens layout, got range "
            f"[{int(values.min())}, {int(values.max())}]"
        )
    return values.to(dtype)


def validate_int_group(payload: QuantPayload) -> None:
    """Raise a ValueError naming the first inconsistent tensor of a qlens int4/int8 payload."""
    require_same_device(payload)
    lead, n, k = weight_dims(payload)
    bits = payload.format.bits
    if bits not in QLENS_INT_BITS:
        raise ValueError(
            f"the qlens integer layout holds 4- or 8-bit codes, got {payload.format.name}; "
            "other widths keep their own packing (gptq, compressed-tensors)"
        )
    if payload.format.zero_point == "float":
        raise ValueError(
            f"{payload.format.name} payload has a float shift (zero_point='float'), which the "
            "qlens integer layout does not hold; it needs layout['packing'] = 'quanto' "
            "(optimum-quanto) or 'torchao' (torchao int4)"
        )
    groups = ceil_div(k, payload.format.block[1])
    if bits == 4:
        require_dtype(payload.data, "data", (torch.uint8,), payload)
        require_shape(payload.data, "data", (*lead, n, ceil_div(k, 2)), payload,
                      fix="int4 packs two codes per byte along K")  # fmt: skip
        require_contiguous(payload.data, "data", payload)
    else:
        require_dtype(payload.data, "data", (torch.int8,), payload)
        require_shape(payload.data, "data", payload.shape, payload)
    scales = check_scales(payload, (*lead, n, groups), tuple(SCALE_DTYPE_NAMES))
    if SCALE_DTYPE_NAMES[scales.dtype] != payload.format.scale_dtype:
        raise ValueError(
            f"{payload.format.name} payload `scales` are {scales.dtype} but the format says "
            f"scale_dtype={payload.format.scale_dtype!r}; build the payload with pack_int_group"
        )
    if (payload.zeros is None) != (payload.format.zero_point == "none"):
        raise ValueError(
            f"{payload.format.name} payload has zero_point={payload.format.zero_point!r} but "
            f"`zeros` is {'missing' if payload.zeros is None else 'present'}; symmetric formats "
            "take zeros=None, asymmetric ones a zero tensor"
        )
    if payload.zeros is not None:
        zero_dtype = torch.uint8 if bits == 4 else torch.int8
        require_dtype(payload.zeros, "zeros", (zero_dtype,), payload)
        require_shape(payload.zeros, "zeros", (*lead, n, groups), payload)


def unpack_qlens_int(payload: QuantPayload) -> IntGroups:
    """Decode a qlens int4/int8 payload to :class:`IntGroups` (unsigned codes)."""
    validate_int_group(payload)
    _, _, k = weight_dims(payload)
    bits = payload.format.bits
    scales = require_tensor(payload.scales, "scales", payload)
    if bits == 4:
        codes = unpack_nibbles(payload.data, k).long()
        zeros = None if payload.zeros is None else payload.zeros.long()
    else:
        codes = payload.data.long() + 128
        zeros = None if payload.zeros is None else payload.zeros.long() + 128
    if zeros is None:
        zeros = torch.full(scales.shape, midpoint(bits), dtype=torch.int64, device=codes.device)
    return IntGroups(
        codes=codes,
        scales=scales,
        zeros=zeros,
        group_index=contiguous_group_index(k, payload.format.block[1], codes.device),
    )


def unpack_int(payload: QuantPayload) -> IntGroups:
    """Decode any integer packing with integer zero points (qlens, gptq, awq,
    compressed-tensors, quanto with an integer shift)."""
    packing = payload.layout.get("packing", "qlens")
    if packing == "qlens":
        return unpack_qlens_int(payload)
    if packing == "quanto":
        from qlens.quant.codecs.quanto_bits import quanto_int_groups

        return quanto_int_groups(payload)
    if payload.format.zero_point == "float":
        raise ValueError(
            f"{payload.format.name} payload in the {packing!r} packing has zero_point='float'; "
            "its codes have no integer zero points (zero_point 'int' or 'none') to decode them "
            "with; dequantize it instead (qlens.dequantize)"
        )
    if packing not in _UNPACKERS:
        raise ValueError(
            f"{payload.format.name} payload has unknown layout['packing']={packing!r}; known: "
            f"{['qlens', *_UNPACKERS]}, 'quanto' (optimum-quanto qint4/qint2) and 'torchao' "
            "(torchao int4 with a float zero point)"
        )
    require_same_device(payload)
    return _UNPACKERS[packing](payload)


def dequantize_int_group(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """``W = (q - z) * s`` per group, in fp32, cast to ``dtype``; the quanto packing computes
    ``s * q - shift`` (or ``s * (q - z)``) in its scales' dtype instead, as quanto does, and the
    torchao packing ``q * s + z`` with a float zero point, in fp32."""
    packing = payload.layout.get("packing")
    if packing == "quanto":
        from qlens.quant.codecs.quanto_bits import dequantize_quanto_bits

        return dequantize_quanto_bits(payload, dtype)
    if packing == "torchao":
        from qlens.quant.codecs.int4_float_zero import dequantize_int4_float_zero

        return dequantize_int4_float_zero(payload, dtype)
    return unpack_int(payload).dequantize(dtype)


def repack_to_qlens(payload: QuantPayload) -> QuantPayload:
    """The same weight in the qlens int4/int8 layout, exactly (codes, zeros and scales kept):
    GPTQ, AWQ and compressed-tensors integer payloads, and GGUF Q4_0 / Q8_0 blocks
    (``qlens.quant.codecs.gguf_repack``).

    Zero points equal to the midpoint everywhere become the symmetric form. GPTQ act-order
    (a ``g_idx`` that is not ``k // group_size``) has no contiguous-group equivalent and raises,
    and so does a float shift (optimum-quanto's default). An integer-shift quanto int4 payload
    repacks, but its product is then computed in fp32 rather than rounded to the scales' dtype.
    """
    if payload.layout.get("packing") == "gguf":
        from qlens.quant.codecs.gguf_repack import gguf_to_int_group

        return gguf_to_int_group(payload)
    if payload.format.zero_point == "float":
        raise ValueError(
            f"this {payload.format.name} payload ({payload.layout.get('packing')!r} packing) has "
            "a float shift or zero point (W = s*q - shift, or q*s + z), which no integer zero "
            "point of the qlens layout expresses exactly; dequantize it instead (qlens.dequantize)"
        )
    if payload.format.bits not in QLENS_INT_BITS:
        raise ValueError(
            f"only 4- and 8-bit integer payloads map to the qlens layout, got {payload.format.name}"
        )
    groups = unpack_int(payload)
    _, _, k = weight_dims(payload)
    group_size = payload.format.block[1]
    expected = contiguous_group_index(k, group_size, groups.group_index.device)
    if not torch.equal(groups.group_index.long(), expected):
        raise ValueError(
            "this GPTQ payload uses act-order (g_idx is not k // group_size), which the qlens "
            "contiguous-group layout cannot express; dequantize it instead (qlens.dequantize)"
        )
    symmetric = bool((groups.zeros == midpoint(payload.format.bits)).all())
    return pack_int_group(
        groups.codes,
        groups.scales,
        None if symmetric else groups.zeros,
        bits=payload.format.bits,
        group_size=group_size,
    )


def validate_int_payload(payload: QuantPayload) -> None:
    """Raise a ValueError naming what is inconsistent in an integer payload of any packing
    (the library packings are checked by decoding them)."""
    packing = payload.layout.get("packing", "qlens")
    if packing == "qlens":
        validate_int_group(payload)
    elif packing == "quanto":
        from qlens.quant.codecs.quanto_bits import validate_quanto_bits

        validate_quanto_bits(payload)
    elif packing == "torchao":
        from qlens.quant.codecs.int4_float_zero import validate_int4_float_zero

        validate_int4_float_zero(payload)
    else:
        unpack_int(payload)


def int_element_scales(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """The group scale (one code step) of every element, float32 ``[*e, N, K]``."""
    if payload.format.zero_point == "float":
        # a float shift or zero point (optimum-quanto, torchao int4): contiguous groups, one
        # scale each (no integer codes' zero point to decode)
        scales = require_tensor(payload.scales, "scales", payload).float()
        return expand_groups(scales, payload.format.block[1], payload.shape[-1])
    groups = unpack_int(payload)
    return groups.scales.float().index_select(-1, groups.group_index.long())


def quantize_int_group(w: Float[Tensor, "*e n k"], options: QuantizeOptions) -> QuantPayload:
    """Round to nearest ``bits``-bit codes per group along K (default 128): symmetric
    ``(q - mid) * s`` with ``s = amax / (mid - 1)``, or with ``asymmetric`` an integer zero
    point and ``s = (max - min) / (2**bits - 1)``; scales rounded up in their dtype."""
    bits = int(options.scheme.removeprefix("int"))
    group = 128 if options.group_size is None else int(options.group_size)
    if group < 1:
        raise ValueError(f"group_size must be a positive int, got {options.group_size}")
    scale_dtype = options.scale_dtype or "fp32"
    dtypes = {name: dtype for dtype, name in SCALE_DTYPE_NAMES.items()}
    if scale_dtype not in dtypes:
        raise ValueError(f"integer scale_dtype must be one of {list(dtypes)}, got {scale_dtype!r}")
    k = w.shape[-1]
    groups = group_view(w, group)
    levels = (1 << bits) - 1
    if options.asymmetric:
        low = groups.amin(dim=-1).clamp(max=0)
        span = groups.amax(dim=-1).clamp(min=0).double() - low.double()
        ideal = torch.where(span > 0, span / levels, torch.ones_like(span))
    else:
        amax = groups.abs().amax(dim=-1).double()
        ideal = torch.where(amax > 0, amax / (levels // 2), torch.ones_like(amax))
    stored = round_scale_up(ideal, dtypes[scale_dtype])
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(
            f"the weight's group ranges (up to {float(ideal.max()) * levels:.4g}) overflow "
            f"{scale_dtype} scales; use scale_dtype='fp32'"
        )
    scale = stored.float()
    ratio = groups / scale.unsqueeze(-1)
    zeros = None
    if options.asymmetric:
        zeros = torch.round(-low / scale).clamp(0, levels)
        codes = (torch.round(ratio) + zeros.unsqueeze(-1)).clamp(0, levels)
    else:
        zero = 1 << (bits - 1)
        codes = torch.round(ratio).clamp(-zero, zero - 1) + zero
    codes = codes.flatten(-2)[..., :k].to(torch.int64)
    return pack_int_group(
        codes,
        stored,
        None if zeros is None else zeros.to(torch.int64),
        bits=bits,
        group_size=group,
    )


_INT_SCHEMES = {
    "int4": "INT4 group-wise (default group 128), symmetric (q-8)*s with s = amax/7, or "
    "asymmetric=True: (q-z)*s with s = (max-min)/15",
    "int8": "INT8 group-wise (default group 128), symmetric q*s with s = amax/127, or "
    "asymmetric=True: (q-z)*s with s = (max-min)/255",
}
INT_CODECS = {
    name: register_codec(
        Codec(
            name,
            dequantize_int_group,
            validate=validate_int_payload,
            element_scales=int_element_scales,
        )
        if name not in _INT_SCHEMES
        else Codec(
            name,
            dequantize_int_group,
            validate=validate_int_payload,
            quantize=quantize_int_group,
            scheme_description=_INT_SCHEMES[name],
            quantize_options=("group_size", "scale_dtype", "asymmetric"),
            element_scales=int_element_scales,
        )
    )
    for name in ("int2", "int3", "int4", "int8")
}
