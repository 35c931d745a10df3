"""GPTQ, AWQ and compressed-tensors integer packings: pack to and unpack from their int32 words.

All three decode to :class:`IntGroups` (unsigned codes, zero points in code units, scales):
- GPTQ: ``qweight i32 [words(K), N]`` packed along K, ``qzeros i32 [G, words(N)]`` packed along N,
  ``scales [G, N]``, optional ``g_idx [K]`` (act-order). Checkpoint format "gptq" (v1) stores
  ``zero - 1`` and is read back as ``stored + 1`` without wrapping (a zero point of 0 has no v1
  encoding; the packer refuses it); "gptq_v2" stores the zero itself.
- AWQ (GEMM): ``qweight i32 [K, N/8]``, ``qzeros i32 [G, N/8]``, both packed along N with nibble
  ``i`` of a word holding column ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``scales [G, N]``; no +1.
- compressed-tensors pack-quantized: ``weight_packed i32 [N, words(K)]`` of ``q + 2**(b-1)``,
  ``weight_scale [N, G]``, asymmetric ``weight_zero_point i32 [words(N), G]`` packed along dim 0
  with the same offset. Words are dense LSB-first bit streams.
Leading expert dims are allowed in front of every tensor.
"""

from __future__ import annotations

import torch
from jaxtyping import Int32, Integer
from torch import Tensor

from qlens.quant.codecs.bits import pack_int32, unpack_int32, words_for
from qlens.quant.codecs.checks import (
    ceil_div,
    require_contiguous,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
    weight_dims,
)
from qlens.quant.codecs.intcodes import IntGroups, contiguous_group_index, midpoint
from qlens.quant.payload import QuantPayload

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def _check_codes(codes: Tensor, bits: int, name: str) -> None:
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(
            f"`{name}` must hold unsigned {bits}-bit codes in [0, {1 << bits}), got range "
            f"[{int(codes.min())}, {int(codes.max())}]"
        )


# --- GPTQ -----------------------------------------------------------------------------------


def pack_gptq(
    codes: Integer[Tensor, "*e n k"],
    scales: Tensor,
    zeros: Integer[Tensor, "*e n g"] | None,
    *,
    bits: int,
    group_size: int,
    checkpoint_format: str = "gptq",
) -> tuple[Int32[Tensor, "*e kw n"], Int32[Tensor, "*e g nw"], Tensor]:
    """``(qweight, qzeros, scales [*e, G, N])`` in GPTQ's layout; ``zeros=None`` is symmetric.

    Act-order is expressed by the caller's ``g_idx`` (stored as ``extras["g_idx"]``): codes,
    scales and zeros here are already per column / per group.
    """
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"checkpoint_format must be one of {GPTQ_FORMATS}, got {checkpoint_format!r}"
        )
    _check_codes(codes, bits, "codes")
    if zeros is None:
        zeros = torch.full(scales.shape, midpoint(bits), dtype=torch.int64, device=codes.device)
    zeros = zeros.long()
    if checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise ValueError(
                "GPTQ v1 ('gptq') stores zero - 1 and cannot represent a zero point of 0; "
                "use checkpoint_format='gptq_v2'"
            )
        zeros = zeros - 1
    _check_codes(zeros, bits, "zeros")
    qweight = _t(pack_int32(codes.long(), bits))
    qzeros = pack_int32(_t(zeros), bits)
    return qweight.contiguous(), qzeros.contiguous(), _t(scales).contiguous()


def unpack_gptq(payload: QuantPayload) -> IntGroups:
    """Decode a ``packing == "gptq"`` payload (validated) to :class:`IntGroups`."""
    lead, n, k = weight_dims(payload)
    bits, group_size = payload.format.bits, payload.format.block[1]
    groups = ceil_div(k, group_size)
    fmt = payload.layout.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(
            f"GPTQ payload layout['checkpoint_format'] must be one of {GPTQ_FORMATS}, got {fmt!r}"
        )
    require_dtype(payload.data, "data (qweight)", (torch.int32,), payload)
    require_shape(payload.data, "data (qweight)", (*lead, words_for(k, bits), n), payload)
    scales = require_tensor(payload.scales, "scales", payload)
    require_dtype(scales, "scales", SCALE_DTYPES, payload)
    require_finite(scales, "scales", payload)
    g_idx = payload.extras.get("g_idx")
    if g_idx is not None:
        require_shape(g_idx, "extra.g_idx", (k,), payload)
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(
                f"GPTQ payload `extra.g_idx` must index groups 0..{groups - 1}, got range "
                f"[{int(g_idx.min())}, {int(g_idx.max())}]"
            )
        group_index = g_idx.long()
    else:
        group_index = contiguous_group_index(k, group_size, payload.data.device)
    require_shape(scales, "scales", (*lead, groups, n), payload, fix="GPTQ scales are [G, N]")
    qzeros = require_tensor(payload.zeros, "zeros (qzeros)", payload)
    require_dtype(qzeros, "zeros (qzeros)", (torch.int32,), payload)
    require_shape(qzeros, "zeros (qzeros)", (*lead, groups, words_for(n, bits)), payload)
    codes = _t(unpack_int32(_t(payload.data), bits, k))
    zeros = unpack_int32(qzeros, bits, n)
    if fmt == "gptq":
        zeros = zeros + 1
    return IntGroups(codes=_t(codes), scales=_t(scales), zeros=_t(zeros), group_index=group_index)


# --- AWQ ------------------------------------------------------------------------------------


def _awq_pack_columns(values: Integer[Tensor, "*e r c"]) -> Int32[Tensor, "*e r w"]:
    cols = values.shape[-1]
    padded = torch.nn.functional.pad(values, (0, -cols % 8))
    order = torch.tensor(AWQ_PACK_ORDER, device=values.device)
    reordered = padded.unflatten(-1, (-1, 8)).index_select(-1, order).flatten(-2)
    return pack_int32(reordered, 4)


def _awq_unpack_columns(words: Int32[Tensor, "*e r w"], cols: int) -> Integer[Tensor, "*e r c"]:
    raw = unpack_int32(words, 4, words.shape[-1] * 8)
    order = torch.tensor(AWQ_UNPACK_ORDER, device=words.device)
    return raw.unflatten(-1, (-1, 8)).index_select(-1, order).flatten(-2)[..., :cols]


def pack_awq(
    codes: Integer[Tensor, "*e n k"],
    scales: Tensor,
    zeros: Integer[Tensor, "*e n g"] | None,
) -> tuple[Int32[Tensor, "*e k nw"], Int32[Tensor, "*e g nw"], Tensor]:
    """``(qweight [K, N/8], qzeros [G, N/8], scales [G, N])`` in AWQ GEMM's 4-bit layout."""
    _check_codes(codes, 4, "codes")
    if zeros is None:
        zeros = torch.full(scales.shape, midpoint(4), dtype=torch.int64, device=codes.device)
    _check_codes(zeros, 4, "zeros")
    qweight = _awq_pack_columns(_t(codes.long()))
    qzeros = _awq_pack_columns(_t(zeros.long()))
    return qweight, qzeros, _t(scales).contiguous()


def unpack_awq(payload: QuantPayload) -> IntGroups:
    """Decode a ``packing == "awq"`` payload (4-bit GEMM layout) to :class:`IntGroups`."""
    lead, n, k = weight_dims(payload)
    if payload.format.bits != 4:
        raise ValueError(f"AWQ GEMM packing is 4-bit only, got a {payload.format.name} payload")
    groups = ceil_div(k, payload.format.block[1])
    n_words = ceil_div(n, 8)
    require_dtype(payload.data, "data (qweight)", (torch.int32,), payload)
    require_shape(payload.data, "data (qweight)", (*lead, k, n_words), payload)
    scales = require_tensor(payload.scales, "scales", payload)
    require_dtype(scales, "scales", SCALE_DTYPES, payload)
    require_finite(scales, "scales", payload)
    require_shape(scales, "scales", (*lead, groups, n), payload, fix="AWQ scales are [G, N]")
    qzeros = require_tensor(payload.zeros, "zeros (qzeros)", payload)
    require_dtype(qzeros, "zeros (qzeros)", (torch.int32,), payload)
    require_shape(qzeros, "zeros (qzeros)", (*lead, groups, n_words), payload)
    codes = _awq_unpack_columns(payload.data, n)
    zeros = _awq_unpack_columns(qzeros, n)
    return IntGroups(
        codes=_t(codes),
        scales=_t(scales),
        zeros=_t(zeros),
        group_index=contiguous_group_index(k, payload.format.block[1], payload.data.device),
    )


# --- compressed-tensors pack-quantized --------------------------------------------------------


def pack_compressed_tensors(
    codes: Integer[Tensor, "*e n k"],
    zeros: Integer[Tensor, "*e n g"] | None,
    *,
    bits: int,
) -> tuple[Int32[Tensor, "*e n kw"], Int32[Tensor, "*e nw g"] | None]:
    """``(weight_packed, weight_zero_point)``: unsigned codes are ``q + 2**(b-1)`` already."""
    _check_codes(codes, bits, "codes")
    packed = pack_int32(codes, bits)
    if zeros is None:
        return packed, None
    _check_codes(zeros, bits, "zeros")
    return packed, _t(pack_int32(_t(zeros.long()), bits)).contiguous()


def unpack_compressed_tensors(payload: QuantPayload) -> IntGroups:
    """Decode a ``packing == "compressed-tensors"`` payload to :class:`IntGroups`."""
    lead, n, k = weight_dims(payload)
    bits = payload.format.bits
    groups = ceil_div(k, payload.format.block[1])
    require_dtype(payload.data, "data (weight_packed)", (torch.int32,), payload)
    require_shape(payload.data, "data (weight_packed)", (*lead, n, words_for(k, bits)), payload)
    require_contiguous(payload.data, "data (weight_packed)", payload)
    scales = require_tensor(payload.scales, "scales", payload)
    require_dtype(scales, "scales", SCALE_DTYPES, payload)
    require_finite(scales, "scales", payload)
    require_shape(scales, "scales", (*lead, n, groups), payload, fix="scales are [N, G]")
    if payload.zeros is None:
        zeros = torch.full(scales.shape, midpoint(bits), dtype=torch.int64, device=scales.device)
    else:
        require_dtype(payload.zeros, "zeros (weight_zero_point)", (torch.int32,), payload)
        expected = (*lead, words_for(n, bits), groups)
        require_shape(payload.zeros, "zeros (weight_zero_point)", expected, payload)
        zeros = _t(unpack_int32(_t(payload.zeros), bits, n))
    return IntGroups(
        codes=unpack_int32(payload.data, bits, k),
        scales=scales,
        zeros=zeros,
        group_index=contiguous_group_index(k, payload.format.block[1], payload.data.device),
    )
