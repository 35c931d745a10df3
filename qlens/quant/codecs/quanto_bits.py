"""optimum-quanto's ``WeightQBitsTensor`` packing (qint4 / qint2): codes, a scale and a shift.

Layout (``layout["packing"] == "quanto"``) of one ``[N, K]`` weight cut into groups of ``g``
consecutive columns (``g`` divides K; quanto's per-row weights are ``g == K``). The
``R = N * K / g`` group rows are numbered row-major (row ``n * K/g + k // g``):

- ``data uint8 [ceil(R / p), g]``, ``p = 8 // bits`` codes per byte: byte ``[j, c]`` holds column
  ``c`` of row ``j + i * ceil(R / p)`` in bits ``[i * bits, (i + 1) * bits)`` (quanto's
  ``PackedTensor``); codes are unsigned, ``0 .. 2**bits - 1``.
- ``scales [N, K/g]``, fp32, bf16 or fp16.
- ``zeros [N, K/g]``, the shift: in the scales' dtype when ``format.zero_point == "float"``
  (``W = s * q - shift``), or uint8 codes when it is ``"int"`` (``W = s * (q - z)``).

Both products are computed in the scales' dtype and rounded there, as quanto does, then cast.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Integer, UInt8
from torch import Tensor

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
from qlens.quant.codecs.intcodes import IntGroups, contiguous_group_index
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES
from qlens.quant.codecs.intpackings import SCALE_DTYPES, _check_codes
from qlens.quant.formats import QuantFormat, int_group_format
from qlens.quant.payload import QuantPayload

QUANTO_BITS = (2, 4)


def pack_quanto_codes(
    codes: Integer[Tensor, "rows group"], bits: int
) -> UInt8[Tensor, "packed group"]:
    """Pack unsigned ``bits``-bit codes as quanto does: ``8 // bits`` row planes per byte."""
    if bits not in QUANTO_BITS:
        raise ValueError(f"quanto packs {QUANTO_BITS}-bit codes, got bits={bits}")
    _check_codes(codes, bits, "codes")
    per = 8 // bits
    rows = ceil_div(codes.shape[0], per)
    padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, rows * per - codes.shape[0]))
    packed = torch.zeros((rows, codes.shape[1]), dtype=torch.uint8, device=codes.device)
    for i, plane in enumerate(padded.split(rows)):
        packed |= plane << (bits * i)
    return packed


def unpack_quanto_codes(
    packed: UInt8[Tensor, "packed group"], bits: int, rows: int
) -> UInt8[Tensor, "rows group"]:
    """Inverse of :func:`pack_quanto_codes`: the first ``rows`` rows of codes."""
    planes = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)]
    return torch.cat(planes)[:rows]


def quanto_bits_payload(
    codes: Integer[Tensor, "n k"],
    scales: Float[Tensor, "n groups"],
    shift: Tensor,
    *,
    bits: int,
    group_size: int,
    source: str = "optimum-quanto",
) -> QuantPayload:
    """A validated quanto-packed payload from unsigned codes ``[N, K]`` (see
    :func:`packed_quanto_payload` for ``scales`` and ``shift``)."""
    if codes.dim() != 2:
        raise ValueError(f"`codes` must be a 2-D [out, in] tensor, got shape {list(codes.shape)}")
    n, k = (int(s) for s in codes.shape)
    if group_size < 1 or k % group_size:
        raise ValueError(
            f"quanto groups must divide in_features: group_size {group_size} does not divide {k}"
        )
    data = pack_quanto_codes(codes.reshape(-1, group_size), bits)
    return packed_quanto_payload(
        data, (n, k), scales, shift, bits=bits, group_size=group_size, source=source
    )


def packed_quanto_payload(
    data: UInt8[Tensor, "packed group"],
    shape: tuple[int, int],
    scales: Float[Tensor, "n groups"],
    shift: Tensor,
    *,
    bits: int,
    group_size: int,
    source: str = "optimum-quanto",
) -> QuantPayload:
    """A validated payload around already packed ``data`` (e.g. a quanto ``PackedTensor``'s).

    ``scales`` and ``shift`` are ``[N, K/g]``; a floating ``shift`` (the scales' dtype) means
    ``W = s*q - shift``, an integer one holds zero-point codes, ``W = s*(q - shift)``.
    """
    require_dtype(scales, "scales", SCALE_DTYPES)
    floating = shift.dtype.is_floating_point
    if not floating:
        _check_codes(shift, bits, "shift")
    payload = QuantPayload(
        format=quanto_bits_format(bits, group_size, scales.dtype, floating),
        data=data,
        shape=tuple(int(s) for s in shape),
        scales=scales,
        zeros=shift if floating else shift.to(torch.uint8),
        layout={"packing": "quanto", "source": source},
    )
    validate_quanto_bits(payload)
    return payload


def quanto_bits_format(
    bits: int, group_size: int, scale_dtype: torch.dtype, float_shift: bool = True
) -> QuantFormat:
    """``int{bits}`` with one ``scale_dtype`` scale and shift (float or int) per ``group_size``."""
    return int_group_format(
        bits,
        group_size,
        zero_point="float" if float_shift else "int",
        scale_dtype=SCALE_DTYPE_NAMES[scale_dtype],
    )


def _groups(payload: QuantPayload) -> tuple[int, int, int]:
    """``(N, K, g)`` of a 2-D quanto payload whose group size divides K."""
    lead, n, k = weight_dims(payload)
    if lead:
        raise ValueError(
            f"{payload.format.name} quanto payload must be one [out, in] weight, got shape "
            f"{list(payload.shape)}; quanto packs each weight on its own"
        )
    g = payload.format.block[1]
    if payload.format.block[0] != 1 or k % g:
        raise ValueError(
            f"{payload.format.name} quanto payload block {payload.format.block} must be (1, g) "
            f"with g dividing in_features {k}"
        )
    return n, k, g


def validate_quanto_bits(payload: QuantPayload) -> None:
    """Raise a ValueError naming the first inconsistent tensor of a quanto-packed payload."""
    require_same_device(payload)
    fmt = payload.format
    if fmt.bits not in QUANTO_BITS or fmt.name != f"int{fmt.bits}":
        raise ValueError(f"quanto packing holds int2 or int4 codes, got a {fmt.name} format")
    if fmt.zero_point not in ("float", "int"):
        raise ValueError(
            f"{fmt.name} quanto payload has zero_point={fmt.zero_point!r}; quanto always stores "
            "a shift: 'float' (W = s*q - shift) or 'int' (W = s*(q - z))"
        )
    n, k, g = _groups(payload)
    rows = ceil_div(n * k // g, 8 // fmt.bits)
    require_dtype(payload.data, "data", (torch.uint8,), payload)
    require_shape(payload.data, "data", (rows, g), payload,
                  fix=f"quanto packs {8 // fmt.bits} group rows per byte")  # fmt: skip
    require_contiguous(payload.data, "data", payload)
    scales = check_scales(payload, (n, k // g), SCALE_DTYPES)
    if SCALE_DTYPE_NAMES[scales.dtype] != fmt.scale_dtype:
        raise ValueError(
            f"{fmt.name} payload `scales` are {scales.dtype} but the format says "
            f"scale_dtype={fmt.scale_dtype!r}; build the payload with quanto_bits_payload"
        )
    _check_shift(payload, scales)


def _check_shift(payload: QuantPayload, scales: Tensor) -> None:
    """The shift (``zeros``): scales' shape, and their dtype (float) or uint8 codes (int)."""
    zeros = require_tensor(payload.zeros, "zeros (shift)", payload, "quanto always stores one")
    require_shape(zeros, "zeros (shift)", scales.shape, payload)
    if payload.format.zero_point == "float":
        require_dtype(zeros, "zeros (shift)", (scales.dtype,), payload,
                      fix="a float shift is stored in the scales' dtype")  # fmt: skip
        require_finite(zeros, "zeros (shift)", payload)
    else:
        require_dtype(zeros, "zeros (shift)", (torch.uint8,), payload)
        _check_codes(zeros, payload.format.bits, "zeros (shift)")


def _codes(payload: QuantPayload) -> UInt8[Tensor, "rows group"]:
    n, k, g = _groups(payload)
    return unpack_quanto_codes(payload.data, payload.format.bits, n * k // g)


def dequantize_quanto_bits(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "n k"]:
    """``s*q - shift`` (or ``s*(q - z)``) in the scales' dtype, as quanto rounds it, cast to
    ``dtype``."""
    validate_quanto_bits(payload)
    scales = require_tensor(payload.scales, "scales", payload).reshape(-1, 1)
    shift = require_tensor(payload.zeros, "zeros (shift)", payload).reshape(-1, 1)
    codes = _codes(payload)
    if payload.format.zero_point == "int":
        weight = scales * (codes.to(torch.int16) - shift.to(torch.int16)).to(scales.dtype)
    else:
        weight = scales * codes.to(scales.dtype) - shift
    return weight.reshape(payload.shape).to(dtype)


def quanto_int_groups(payload: QuantPayload) -> IntGroups:
    """:class:`IntGroups` of an integer-shift quanto payload; a float shift has none."""
    validate_quanto_bits(payload)
    if payload.format.zero_point != "int":
        raise ValueError(
            f"this quanto {payload.format.name} payload has a float shift (W = s*q - shift), "
            "which no integer zero point expresses exactly; dequantize it instead "
            "(qlens.dequantize)"
        )
    n, k, g = _groups(payload)
    scales = require_tensor(payload.scales, "scales", payload)
    zeros = require_tensor(payload.zeros, "zeros (shift)", payload)
    return IntGroups(
        codes=_codes(payload).reshape(n, k).long(),
        scales=scales,
        zeros=zeros.long(),
        group_index=contiguous_group_index(k, g, payload.data.device),
    )
