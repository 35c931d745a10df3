"""HQQ (half-quadratic quantization) weights: bit-planed unsigned codes, a float zero and scale.

Layout (``layout["packing"] == "hqq"``) of one ``[N, K]`` weight quantized in groups of ``g``
along ``axis`` of the row-major flattened weight: axis 1 views it as ``[N*K/g, g]`` (each row a
group of ``g`` consecutive weights), axis 0 as ``[g, N*K/g]`` (each column a group).

- ``data`` holds the codes of that 2-D view, bit-planed along its first dim: ``uint8`` with
  ``p = 8 // bits`` planes (1, 2, 4 and 8 bits; plane ``i`` of byte row ``j`` is code row
  ``j + i * rows``, plane 0 in the highest bits), or ``int32`` with ten 3-bit planes (3 bits,
  plane 0 in bits 27-29, rows padded to a multiple of ten). With ``view_as_float`` the bytes are
  stored viewed as a float dtype.
- ``scales`` and ``zeros`` ``[N*K/g, 1]`` (axis 1) or ``[1, N*K/g]`` (axis 0), float.

``W = (codes - zeros) * scales``: the codes are converted to ``layout["compute_dtype"]`` and the
arithmetic follows torch's type promotion, as ``hqq.core.quantize.Quantizer.dequantize`` does,
so the result is bit-exact against HQQ in its own dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qlens.quant.codecs.checks import require_dtype, require_shape, require_tensor
from qlens.quant.codecs.codec import Codec
from qlens.quant.codecs.registry import register_codec
from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

HQQ_BITS = (1, 2, 3, 4, 8)
_FLOAT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES_BY_NAME = {str(d).removeprefix("torch."): d for d in _FLOAT_NAMES}


def hqq_format(bits: int, group_size: int, axis: int, scale_dtype: torch.dtype) -> QuantFormat:
    """HQQ codes of ``bits`` bits with a float zero and scale per group of ``group_size``."""
    if bits not in HQQ_BITS:
        raise ValueError(f"HQQ packs {HQQ_BITS}-bit codes, got {bits}")
    if axis not in (0, 1):
        raise ValueError(f"HQQ groups along axis 0 or 1, got {axis}")
    if scale_dtype not in _FLOAT_NAMES:
        raise ValueError(f"HQQ scales must be fp32, bf16 or fp16, got {scale_dtype}")
    along = "consecutive weights" if axis == 1 else "weights strided by N*K/g"
    return QuantFormat(
        name="hqq",
        element=f"uint{bits}",
        bits=bits,
        block=(1, group_size) if axis == 1 else (group_size, 1),
        scale_dtype=_FLOAT_NAMES[scale_dtype],
        zero_point="float",
        description=f"HQQ uint{bits} codes, W = (q - zero) * scale per group of {group_size} "
        f"{along}",
    )


def _plane_layout(bits: int) -> tuple[int, int, torch.dtype]:
    """(planes per word, bits per word used, word dtype) of HQQ's bit packing."""
    if bits == 3:
        return 10, 30, torch.int32
    return 8 // bits, 8, torch.uint8


def _group_rows(payload: QuantPayload) -> int:
    """Rows of the 2-D view the codes are packed in: groups (axis 1) or group size (axis 0)."""
    n, k = payload.shape
    group = payload.format.block[1] if payload.layout["axis"] == 1 else payload.format.block[0]
    return n * k // group if payload.layout["axis"] == 1 else group


def unpack_hqq_codes(payload: QuantPayload) -> Tensor:
    """The codes of an HQQ payload in its 2-D group view, as ``layout["compute_dtype"]``."""
    bits = payload.format.bits
    planes, width, word = _plane_layout(bits)
    data = require_tensor(payload.data, "data", payload)
    if payload.layout.get("view_as_float"):
        data = data.view(word)
    require_dtype(data, "data", (word,), payload)
    mask = (1 << bits) - 1
    unpacked = torch.cat([(data >> (width - bits * (i + 1))) & mask for i in range(planes)])
    rows = _group_rows(payload)
    return unpacked[:rows].to(_DTYPES_BY_NAME[payload.layout["compute_dtype"]])


def validate_hqq(payload: QuantPayload) -> None:
    """Raise a ValueError if the scales or zeros do not match the HQQ groups."""
    n, k = payload.shape
    group = payload.format.block[1] if payload.layout["axis"] == 1 else payload.format.block[0]
    if (n * k) % group:
        raise ValueError(f"HQQ group size {group} does not divide the {n}x{k} weight")
    groups = n * k // group
    expected = [groups, 1] if payload.layout["axis"] == 1 else [1, groups]
    for name in ("scales", "zeros"):
        value = require_tensor(getattr(payload, name), name, payload)
        require_shape(value, name, expected, payload)


def dequantize_hqq(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """``(codes - zeros) * scales`` reshaped to ``[N, K]``, computed as HQQ does, then cast."""
    validate_hqq(payload)
    codes = unpack_hqq_codes(payload)
    assert payload.zeros is not None and payload.scales is not None  # checked above
    weight = ((codes - payload.zeros) * payload.scales).reshape(payload.shape)
    return weight.to(dtype)


HQQ_CODEC = register_codec(Codec("hqq", dequantize_hqq, validate=validate_hqq))
