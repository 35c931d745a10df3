"""GGUF (GGML) block formats Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quants Q2_K-Q6_K and MXFP4, in pure torch.

A payload keeps GGML's raw blocks: ``data`` is ``uint8 [..., row_bytes]`` (one row of blocks per
logical row, K = blocks_per_row * block_size), ``shape`` the logical ``[..., K]`` shape, scales live
inside the blocks (``scales`` is None). ``layout["ggml_type"]`` is the GGML type id.
``extras["input_permutation"]`` (int64 ``[K]``, optional) maps block column ``j`` to logical column
``perm[j]`` (transformers' ``GgufLinear.input_permutation``: ``W[:, perm[j]] = W_blocks[:, j]``).

Element orders (per GGML): Q4_0/Q4_1/Q5_0/Q5_1 hold a 32-block's low 4 bits in 16 bytes, low
nibbles = elements 0-15, high nibbles = 16-31, and Q5's fifth bit of element j in bit j of a
little-endian uint32. K-quants use 256-blocks: Q4_K/Q5_K hold 8 sub-blocks of 32 as 4 runs of
32 bytes (low nibbles one sub-block, high nibbles the next), Q5_K's fifth bit of sub-block g in
bit g of 32 bytes; Q2_K (and Q3_K's low 2 bits, its third bit inverted in a 32-byte mask)
packs 2-bit codes 4 per byte over 128-element halves; Q6_K splits the low 4 bits and high 2 bits
over 128-element halves. ``d`` scales are float16; K-quant sub-block scales are 6-bit
(Q3_K-Q5_K), 4-bit (Q2_K) or int8 (Q6_K). MXFP4 (type 39) blocks are 17 bytes per 32: an E8M0
exponent byte ``e`` then 16 bytes of E2M1 codes (low nibbles elements 0-15, high 16-31); GGML
scales the doubled E2M1 values (0, 1, 2, 3, 4, 6, 8, 12, negated for codes 8-15) by
``2^(e - 128)`` (``ggml_e8m0_to_fp32_half``: E8M0's bias of 127, halved).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.checks import require_dtype, require_same_device, require_shape
from qlens.quant.codecs.codec import Codec
from qlens.quant.codecs.registry import register_codec
from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

PACKING = "gguf"


@dataclass(frozen=True)
class GgmlType:
    """A GGML block type: id, elements per block and bytes per block."""

    name: str
    type_id: int
    block_size: int
    type_size: int


Q4_0 = GgmlType("Q4_0", 2, 32, 18)
Q4_1 = GgmlType("Q4_1", 3, 32, 20)
Q5_0 = GgmlType("Q5_0", 6, 32, 22)
Q5_1 = GgmlType("Q5_1", 7, 32, 24)
Q8_0 = GgmlType("Q8_0", 8, 32, 34)
Q2_K = GgmlType("Q2_K", 10, 256, 84)
Q3_K = GgmlType("Q3_K", 11, 256, 110)
Q4_K = GgmlType("Q4_K", 12, 256, 144)
Q5_K = GgmlType("Q5_K", 13, 256, 176)
Q6_K = GgmlType("Q6_K", 14, 256, 210)
MXFP4 = GgmlType("MXFP4", 39, 32, 17)
GGML_TYPES = {
    t.type_id: t for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4)
}
# E2M1 code -> twice its value (GGML's kvalues_mxfp4).
_MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def gguf_format(ggml_type: GgmlType) -> QuantFormat:
    """The :class:`QuantFormat` of a GGML block type."""
    return QuantFormat(
        name=f"gguf_{ggml_type.name.lower()}",
        element=ggml_type.name.lower(),
        bits=8 * ggml_type.type_size // ggml_type.block_size,
        block=(1, ggml_type.block_size),
        scale_dtype="e8m0" if ggml_type is MXFP4 else "fp16",
        zero_point="float" if ggml_type in (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) else "none",
        description=f"GGML {ggml_type.name} blocks ({ggml_type.type_size} bytes per "
        f"{ggml_type.block_size} weights)",
    )


def ggml_type_by_id(type_id: int) -> GgmlType:
    """The GGML type with id ``type_id``; raises naming the supported ones."""
    try:
        return GGML_TYPES[type_id]
    except KeyError:
        known = ", ".join(f"{t.name}={t.type_id}" for t in GGML_TYPES.values())
        raise ValueError(f"GGML type id {type_id} is not supported; supported: {known}") from None


def row_bytes(ggml_type: GgmlType, n_cols: int) -> int:
    """Bytes of one packed row of ``n_cols`` weights; ``n_cols`` must fill whole blocks."""
    if n_cols % ggml_type.block_size:
        raise ValueError(
            f"GGML {ggml_type.name} rows hold multiples of {ggml_type.block_size} weights, "
            f"got {n_cols}"
        )
    return n_cols // ggml_type.block_size * ggml_type.type_size


def block_f16(blocks: Tensor, start: int) -> Tensor:
    """The little-endian float16 at byte ``start`` of each block, ``[blocks, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16)


def _f16(blocks: Tensor, start: int) -> Tensor:
    """``block_f16`` as float32."""
    return block_f16(blocks, start).to(torch.float32)


def low_high_nibbles(packed: Tensor, width: int) -> Tensor:
    """Nibbles of ``packed [blocks, groups*width]``: per group the low nibbles, then the high."""
    grouped = packed.reshape(packed.shape[0], -1, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device).reshape(1, 1, 2, 1)
    return ((grouped >> shifts) & 0xF).reshape(packed.shape[0], -1)


def _bit_planes(packed: Tensor) -> Tensor:
    """Bits of ``packed [blocks, n]``, LSB first: ``[blocks, 8, n]`` (plane ``b`` = bit ``b``)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device).reshape(1, 8, 1)
    return (packed.unsqueeze(1) >> shifts) & 1


def _q4_0(blocks: Tensor) -> Tensor:
    q = low_high_nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return _f16(blocks, 0) * q.to(torch.float32)


def _q4_1(blocks: Tensor) -> Tensor:
    q = low_high_nibbles(blocks[:, 4:], 16).to(torch.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5_low_bits(blocks: Tensor, start: int) -> Tensor:
    """Q5_0/Q5_1 5-bit codes: a little-endian 32-bit high-bit mask at ``start``, then nibbles."""
    high = _bit_planes(blocks[:, start : start + 4]).transpose(1, 2).reshape(-1, 32)
    return low_high_nibbles(blocks[:, start + 4 :], 16) | (high << 4)


def _q5_0(blocks: Tensor) -> Tensor:
    q = _q5_low_bits(blocks, 2).to(torch.int8) - 16
    return _f16(blocks, 0) * q.to(torch.float32)


def _q5_1(blocks: Tensor) -> Tensor:
    q = _q5_low_bits(blocks, 4).to(torch.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q8_0(blocks: Tensor) -> Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * _f16(blocks, 0)


def _k_scales(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K: eight 6-bit sub-block scales and mins packed in 12 bytes at offset 4, each
    multiplied by the block's float16 ``d`` / ``dmin``: ``[blocks, 8, 1]`` twice."""
    n = blocks.shape[0]
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, mins, high = packed[:, 0], packed[:, 1], packed[:, 2]
    scale6 = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    min6 = torch.cat([mins & 0x3F, (high >> 4) | ((mins >> 2) & 0x30)], dim=-1)
    d = (_f16(blocks, 0) * scale6.to(torch.float32)).reshape(n, 8, 1)
    dmin = (_f16(blocks, 2) * min6.to(torch.float32)).reshape(n, 8, 1)
    return d, dmin


def _q4_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, dmin = _k_scales(blocks)
    q = low_high_nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (d * q - dmin).reshape(n, 256)


def _q5_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, dmin = _k_scales(blocks)
    high = _bit_planes(blocks[:, 16:48])  # [n, 8, 32]: plane g = high bit of sub-block g
    low = low_high_nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.float32)
    return (d * q - dmin).reshape(n, 256)


def _q2_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    sub = blocks[:, :16]
    d = (_f16(blocks, 80) * (sub & 0xF).to(torch.float32)).reshape(n, 16, 1)
    dmin = (_f16(blocks, 82) * (sub >> 4).to(torch.float32)).reshape(n, 16, 1)
    packed = blocks[:, 16:80].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    q = ((packed >> shifts.reshape(1, 1, 4, 1)) & 0x3).reshape(n, 16, 16).to(torch.float32)
    return (d * q - dmin).reshape(n, 256)


def _q3_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    packed = blocks[:, 96:108]  # 16 6-bit scales: low 4 bits in bytes 0-7, high 2 in bytes 8-11
    low = torch.stack([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=1).reshape(n, 16)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = ((packed[:, 8:].unsqueeze(1) >> shifts.reshape(1, 4, 1)) & 0x3).reshape(n, 16)
    sub_scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    d = (_f16(blocks, 108) * sub_scales).reshape(n, 16, 1)
    two_bits = blocks[:, 32:96].reshape(n, 2, 1, 32)
    q_low = ((two_bits >> shifts.reshape(1, 1, 4, 1)) & 0x3).reshape(n, 16, 16)
    # The third bit is stored inverted: a clear hmask bit subtracts 4.
    cleared = (_bit_planes(blocks[:, :32]).reshape(n, 16, 16) ^ 1).to(torch.int8)
    q = (q_low.to(torch.int8) - (cleared << 2)).to(torch.float32)
    return (d * q).reshape(n, 256)


def _q6_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    low = low_high_nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    high_bytes = blocks[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = ((high_bytes >> shifts.reshape(1, 1, 4, 1)) & 0x3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    sub_scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(blocks, 208) * sub_scales).reshape(n, 16, 1)
    return (d * q).reshape(n, 256)


def _e8m0_half(exponents: Tensor) -> Tensor:
    """``2^(e - 128)`` in float32 from E8M0 bytes, bit-built as GGML does (denormal for e < 2)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: Tensor) -> Tensor:
    codes = low_high_nibbles(blocks[:, 1:], 16).to(torch.int64)
    table = torch.tensor(_MXFP4_DOUBLED, dtype=torch.float32, device=blocks.device)
    return _e8m0_half(blocks[:, :1]) * table[codes]


_DECODERS: dict[int, Callable[[Tensor], Tensor]] = {
    Q4_0.type_id: _q4_0,
    Q4_1.type_id: _q4_1,
    Q5_0.type_id: _q5_0,
    Q5_1.type_id: _q5_1,
    Q8_0.type_id: _q8_0,
    Q2_K.type_id: _q2_k,
    Q3_K.type_id: _q3_k,
    Q4_K.type_id: _q4_k,
    Q5_K.type_id: _q5_k,
    Q6_K.type_id: _q6_k,
    MXFP4.type_id: _mxfp4,
}


def dequantize_gguf_rows(data: Tensor, ggml_type: GgmlType) -> Float[Tensor, "*rows cols"]:
    """Decode raw GGML blocks ``uint8 [..., row_bytes]`` to float32 ``[..., cols]``."""
    if data.dtype != torch.uint8:
        raise ValueError(f"GGUF block data must be torch.uint8, got {data.dtype}")
    if data.ndim == 0 or data.shape[-1] % ggml_type.type_size:
        raise ValueError(
            f"GGUF {ggml_type.name} rows must be whole {ggml_type.type_size}-byte blocks, got "
            f"data shape {list(data.shape)}"
        )
    blocks = data.reshape(-1, ggml_type.type_size)
    values = _DECODERS[ggml_type.type_id](blocks)
    cols = data.shape[-1] // ggml_type.type_size * ggml_type.block_size
    return values.reshape(*data.shape[:-1], cols)


def validate_gguf_payload(payload: QuantPayload) -> GgmlType:
    """The payload's GGML type, after checking its layout flag, data dtype, shape and device."""
    by_name = {gguf_format(t).name: t for t in GGML_TYPES.values()}
    if payload.format.name not in by_name:
        raise ValueError(f"{payload.format.name!r} is not a GGUF format; known: {sorted(by_name)}")
    ggml_type = by_name[payload.format.name]
    layout_id = payload.layout.get("ggml_type", ggml_type.type_id)
    if layout_id != ggml_type.type_id:
        raise ValueError(
            f"payload format {payload.format.name} is GGML type {ggml_type.type_id} but "
            f"layout['ggml_type'] says {layout_id}"
        )
    shape = tuple(int(s) for s in payload.shape)
    if not shape:
        raise ValueError("a GGUF payload needs a shape of at least one dimension [..., cols]")
    require_dtype(payload.data, "data", (torch.uint8,), payload)
    require_shape(
        payload.data,
        "data",
        (*shape[:-1], row_bytes(ggml_type, shape[-1])),
        payload,
        fix=f"GGML rows hold {ggml_type.type_size}-byte blocks of {ggml_type.block_size} weights",
    )
    require_same_device(payload)
    return ggml_type


def gguf_input_permutation(payload: QuantPayload, *, check_values: bool) -> Tensor | None:
    """``extras["input_permutation"]`` (int64 ``[K]``, checked to be a permutation when asked)."""
    perm = payload.extras.get("input_permutation")
    if perm is None:
        return None
    k = int(payload.shape[-1])
    require_dtype(perm, "extra.input_permutation", (torch.int64,), payload)
    require_shape(perm, "extra.input_permutation", (k,), payload)
    if check_values and not torch.equal(perm.sort().values, torch.arange(k, device=perm.device)):
        raise ValueError("extras['input_permutation'] is not a permutation of 0..K-1")
    return perm.contiguous()


def dequantize_gguf(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "..."]:
    """Reconstruct a GGUF-packed weight (float32 math as in gguf-py, then cast to ``dtype``)."""
    if not dtype.is_floating_point:
        raise ValueError(f"GGUF weights dequantize to a float dtype, not {dtype}")
    ggml_type = validate_gguf_payload(payload)
    weight = dequantize_gguf_rows(payload.data, ggml_type)
    perm = gguf_input_permutation(payload, check_values=True)
    if perm is not None:
        permuted = torch.empty_like(weight)
        permuted[..., perm] = weight
        weight = permuted
    return weight.to(dtype)


for _ggml_type in GGML_TYPES.values():
    register_codec(
        Codec(gguf_format(_ggml_type).name, dequantize_gguf, validate=validate_gguf_payload)
    )
