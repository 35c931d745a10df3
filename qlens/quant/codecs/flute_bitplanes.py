"""FLUTE's 3-bit layout (flute-kernel 0.4.2, TileP 32): codes split across 16-bit words.

Codes ``[K, N]`` are taken in row pairs ``(2a, 2a + 1)`` and column chunks of 512 (16 sub-chunks
of 32). For each pair ``a``, chunk ``c`` and lane ``t < 32`` the 32 codes

    v[j] = codes[2a + 1 - j % 2, 512 c + 32 SUB_CHUNKS[j // 2] + t]

form a 96-bit stream (code ``j``'s bit ``i`` at position ``3j + i``), cut into six 16-bit words
``w[r][p]`` (``r`` < 2, ``p`` < 3): ``w[0][p]`` holds stream bits ``30p .. 30p + 15``, ``w[1][p]``
bits ``30p + 16 .. 30p + 29`` in its bits 0..13 and ``90 + 2p, 91 + 2p`` in bits 14 and 15.
Row ``2a + r`` of the packed ``[K, 3N/16]`` matrix (stored transposed, ``[3N/16, K]``) holds first
the words ``w[r][0]`` in ``(c, t)`` order, then ``w[r][1], w[r][2]`` in ``(c, p, t)`` order.
"""

from __future__ import annotations

import torch
from jaxtyping import Int16, Integer
from torch import Tensor

BITS = 3
TILE_P = 32
CHUNK = 16 * TILE_P  # columns per chunk
SUB_CHUNKS = (0, 3, 6, 9, 12, 1, 4, 7, 10, 13, 2, 5, 8, 11, 14, 15)


def _stream_positions() -> Tensor:
    """``[2, 3, 16]``: the stream bit held by bit ``b`` of word ``w[r][p]``."""
    pos = torch.empty(2, 3, 16, dtype=torch.int64)
    for p in range(3):
        pos[0, p] = 30 * p + torch.arange(16)
        pos[1, p, :14] = 30 * p + 16 + torch.arange(14)
        pos[1, p, 14:] = 90 + 2 * p + torch.arange(2)
    return pos


def _selectors(device: torch.device) -> tuple[Tensor, Tensor]:
    slots = torch.arange(32, device=device)
    rows = 1 - slots % 2
    sub = torch.tensor(SUB_CHUNKS, device=device)[slots // 2]
    return rows, sub


def check_geometry(k: int, n: int, tile_p: int) -> None:
    if tile_p != TILE_P:
        raise ValueError(f"FLUTE 3-bit packing exists for tile_p={TILE_P} only, got {tile_p}")
    if k % 2 or n % CHUNK:
        raise ValueError(
            f"FLUTE 3-bit packing needs an even K and N a multiple of {CHUNK}, got K={k}, N={n}"
        )


def pack_3bit(codes: Integer[Tensor, "k n"]) -> Int16[Tensor, "w k"]:
    """Pack ``[K, N]`` codes in ``[0, 8)`` (geometry already checked) into ``[3N/16, K]``."""
    k, n = codes.shape
    a, c = k // 2, n // CHUNK
    rows, sub = _selectors(codes.device)
    grid = codes.to(torch.int64).reshape(a, 2, c, 16, TILE_P)
    v = grid[:, rows, :, sub, :].permute(1, 2, 3, 0)  # [a, c, t, 32 slots]
    stream = ((v[..., None] >> torch.arange(BITS, device=codes.device)) & 1).reshape(a, c, 32, 96)
    bits = stream[..., _stream_positions().to(codes.device)]  # [a, c, t, 2, 3, 16]
    words = (bits << torch.arange(16, device=codes.device)).sum(-1)  # [a, c, t, 2, 3]
    plane0 = words[..., 0].permute(0, 3, 1, 2).reshape(k, c * TILE_P)
    planes12 = words[..., 1:].permute(0, 3, 1, 4, 2).reshape(k, c * 2 * TILE_P)
    packed = torch.cat([plane0, planes12], dim=1)
    packed = torch.where(packed >= 1 << 15, packed - (1 << 16), packed).to(torch.int16)
    return packed.T.contiguous()


def unpack_3bit(data: Int16[Tensor, "w k"], n: int) -> Integer[Tensor, "k n"]:
    """Inverse of :func:`pack_3bit`: the ``[K, N]`` codes (int64)."""
    k = data.shape[1]
    a, c = k // 2, n // CHUNK
    rows_words = data.T.to(torch.int64) & 0xFFFF  # [K, 3N/16]
    plane0 = rows_words[:, : c * TILE_P].reshape(a, 2, c, TILE_P).permute(0, 2, 3, 1)
    planes12 = rows_words[:, c * TILE_P :].reshape(a, 2, c, 2, TILE_P).permute(0, 2, 4, 1, 3)
    words = torch.cat([plane0[..., None], planes12], dim=-1)  # [a, c, t, 2, 3]
    bits = (words[..., None] >> torch.arange(16, device=data.device)) & 1  # [a, c, t, 2, 3, 16]
    stream = torch.empty((a, c, TILE_P, 96), dtype=torch.int64, device=data.device)
    stream[..., _stream_positions().to(data.device).reshape(-1)] = bits.reshape(a, c, TILE_P, 96)
    v = (stream.reshape(a, c, TILE_P, 32, BITS) << torch.arange(BITS, device=data.device)).sum(-1)
    rows, sub = _selectors(data.device)
    codes = torch.empty((a, 2, c, 16, TILE_P), dtype=torch.int64, device=data.device)
    codes[:, rows, :, sub, :] = v.permute(3, 0, 1, 2)
    return codes.reshape(k, n)
