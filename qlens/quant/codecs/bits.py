"""Bit packing shared by the codecs: 4-bit nibbles in bytes and b-bit fields in int32 words."""

from __future__ import annotations

import torch
from jaxtyping import Int32, Integer, UInt8
from torch import Tensor

_WORD = 32
_MASK32 = (1 << _WORD) - 1


def pack_nibbles(codes: UInt8[Tensor, "*lead k"]) -> UInt8[Tensor, "*lead half"]:
    """Pack 4-bit codes two per byte along the last dim, low nibble = even index.

    An odd length is padded with a zero code.
    """
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.unflatten(-1, (-1, 2))
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: UInt8[Tensor, "*lead half"], k: int) -> UInt8[Tensor, "*lead k"]:
    """Inverse of :func:`pack_nibbles`: the first ``k`` 4-bit codes of each row."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return codes[..., :k]


def words_for(length: int, bits: int) -> int:
    """Number of int32 words holding ``length`` densely packed ``bits``-bit fields."""
    return -(-length * bits // _WORD)


def pack_int32(values: Integer[Tensor, "*lead length"], bits: int) -> Int32[Tensor, "*lead words"]:
    """Pack unsigned ``bits``-bit fields densely along the last dim into int32 words.

    Field ``i`` starts at global bit ``i * bits`` of a little-endian bit stream (LSB first), so a
    field may straddle two words when 32 is not a multiple of ``bits`` (GPTQ 3-bit, dense
    compressed-tensors). Values must lie in ``[0, 2**bits)``.
    """
    length = values.shape[-1]
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(
            f"values to pack must lie in [0, {1 << bits}) for {bits}-bit fields; got range "
            f"[{int(v.min())}, {int(v.max())}]; offset signed values first"
        )
    n_words = words_for(length, bits)
    if _WORD % bits == 0:  # fields never straddle: shift each into its slot of the word
        per_word = _WORD // bits
        slots = torch.nn.functional.pad(v, (0, n_words * per_word - length))
        shifts = torch.arange(per_word, device=v.device) * bits
        packed = (slots.unflatten(-1, (n_words, per_word)) << shifts).sum(-1)
        return torch.where(packed >= 1 << 31, packed - (1 << _WORD), packed).to(torch.int32)
    start = torch.arange(length, device=v.device) * bits
    word, shift = start // _WORD, start % _WORD
    low = (v << shift) & _MASK32
    spill = torch.where(shift + bits > _WORD, v >> (_WORD - shift), torch.zeros_like(v))
    packed = torch.zeros((*v.shape[:-1], n_words + 1), dtype=torch.int64, device=v.device)
    index = word.expand(v.shape)
    packed.scatter_add_(-1, index, low)  # fields never overlap, so adding is OR-ing
    packed.scatter_add_(-1, index + 1, spill)
    packed = packed[..., :n_words]
    return torch.where(packed >= 1 << 31, packed - (1 << _WORD), packed).to(torch.int32)


def unpack_int32(
    words: Int32[Tensor, "*lead words"], bits: int, length: int
) -> Integer[Tensor, "*lead length"]:
    """Inverse of :func:`pack_int32`: the first ``length`` unsigned fields of each row, as int64."""
    if words.shape[-1] < words_for(length, bits):
        raise ValueError(
            f"{words.shape[-1]} int32 words hold fewer than {length} {bits}-bit fields; "
            f"expected at least {words_for(length, bits)} words"
        )
    if _WORD % bits == 0:  # fields never straddle: one shift-and-mask per slot
        per_word = _WORD // bits
        shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
        fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return fields.flatten(-2)[..., :length].to(torch.int64)
    w = words.to(torch.int64) & _MASK32
    w = torch.nn.functional.pad(w, (0, 1))
    start = torch.arange(length, device=w.device) * bits
    word, shift = start // _WORD, start % _WORD
    index = word.expand((*w.shape[:-1], length))
    low = torch.gather(w, -1, index) >> shift
    high = torch.gather(w, -1, index + 1) << (_WORD - shift)
    return (low | high) & ((1 << bits) - 1)
