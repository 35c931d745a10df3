"""HIGGS weights (transformers ``HiggsLinear``): FLUTE-packed codes, a code table, Hadamard blocks.

Payload (``layout["packing"] == "flute"``) for a logical ``[N, K]`` weight, ``Kp = ceil(K/H)*H``:
- ``data`` int16 ``[N*b/16, Kp]``: ``b``-bit codes ``C[Kp, N]`` shuffled by FLUTE's ``_pack_4bit`` /
  ``_pack_2bit`` pattern (``layout["tile_p"]`` = the kernel template's TileP, 32 or 64), written as
  an LSB-first bit stream into int16 words, viewed ``[Kp, N*b/16]`` and transposed; 3-bit codes
  (TileP 32) are spread over bit planes as ``flute_bitplanes`` describes.
- ``extras["tables2"]`` ``[2**b, 2**b, 2]``: for consecutive rows ``(2j, 2j+1)`` of ``C`` the pair
  of values ``tables2[C[2j], C[2j+1]]``. Its 16-bit patterns are values of the ``scales`` dtype
  (bf16 or fp16) whatever dtype label the tensor carries (transformers stores bf16 bits viewed
  as float16); they are reinterpreted, never converted.
- ``scales`` ``[N, Kp/g]`` (g = ``format.block[1]``), ``layout["hadamard_size"]`` = H.

Reconstruction: ``V[n, k] = tables2 value * scales[n, k // g]`` (the kernel scales codes in the
rotated domain), then per row and per H-block ``W = V @ Had_H / sqrt(H)`` with the Sylvester ±1
Hadamard matrix, cropped to K. For HIGGS' own quantizer the scale is constant over each H-block, so
this equals ``Had(table values) / sqrt(H) * scale``.

What is verified and what derived (``tests/quant/test_higgs_flute_oracle.py``): FLUTE's decoder
is a CUDA GEMM, but its own test pins it bit for bit to a plain-torch reference,
``vector_dequantize_higgs`` (HIGGS vector codes and scales to the rotated-domain weight). The
packing (2, 3 and 4 bits) equals FLUTE's pure-torch packers exactly, and HIGGS codes and scales
packed that way decode here to that reference's values rotated by torchao's CPU Hadamard
transform (``matmul_hadU_slow``, its CPU stand-in for ``fast_hadamard_transform``, which
transformers' ``quantize_with_higgs`` uses), bit for bit in float32 (p = 1 and 2).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int16, Integer
from torch import Tensor

from qlens.quant.codecs import flute_bitplanes
from qlens.quant.codecs.checks import (
    ceil_div,
    require_dtype,
    require_finite,
    require_same_device,
    require_shape,
    require_tensor,
)
from qlens.quant.codecs.registry import register_dequantizer
from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

PACKING = "flute"
WORD_BITS = 16
SUPPORTED_BITS = (2, 3, 4)  # 3-bit: FLUTE's bit-plane layout, ``flute_bitplanes``
TILE_PS = (32, 64)
TABLE_DTYPES = (torch.float16, torch.bfloat16)


def higgs_format(num_bits: int, group_size: int, scale_dtype: torch.dtype) -> QuantFormat:
    """The :class:`QuantFormat` of HIGGS weights with ``num_bits`` codes per weight."""
    if num_bits not in SUPPORTED_BITS:
        raise NotImplementedError(
            f"HIGGS {num_bits}-bit weights are not supported; supported: {SUPPORTED_BITS}"
        )
    if scale_dtype not in TABLE_DTYPES:
        raise ValueError(f"HIGGS scales are float16 or bfloat16, got {scale_dtype}")
    return QuantFormat(
        name="higgs",
        element="higgs_vq",
        bits=num_bits,
        block=(1, int(group_size)),
        scale_dtype="fp16" if scale_dtype == torch.float16 else "bf16",
        description=f"HIGGS {num_bits}-bit FLUTE codes, scale per {group_size}, Hadamard blocks",
    )


def flute_tile_p(num_bits: int, template_id: int) -> int:
    """TileP of FLUTE 0.4.2's kernel template ``template_id`` (its packing granularity).

    From ``flute/data/qgemm_kernel_raw_generated_configs.pth``: 4-bit templates repeat every 48
    ids with TileP 64 for the first 16 and 32 for the rest; 2/3-bit ones every 12 with 64 for
    the first 4.
    """
    if num_bits == 4 and 0 <= template_id < 144:
        return 64 if template_id % 48 < 16 else 32
    if num_bits in (2, 3) and 0 <= template_id < 36:
        return 64 if template_id % 12 < 4 else 32
    raise ValueError(f"no FLUTE template {template_id} for {num_bits}-bit weights")


def _shuffle(codes: Tensor, num_bits: int, tile_p: int) -> Tensor:
    """FLUTE's reordering of a ``[K, N]`` code matrix before bit packing.

    Rows are taken in pairs; columns in chunks of ``c * tile_p`` (``c = 16 / b`` sub-chunks of
    ``tile_p``), within which element ``(s, p)`` moves to position ``(p, s)``. The ``2c``
    (row-of-pair, sub-chunk) slots are then refilled so that output slot ``o`` takes sub-chunk
    ``o // 2`` of row ``1 - o % 2``.
    """
    k, n = codes.shape
    c = WORD_BITS // num_bits
    chunks = codes.reshape(k // 2, 2, n // (c * tile_p), c, tile_p).transpose(-1, -2)
    slots = [chunks[:, 1 - o % 2, :, :, o // 2] for o in range(2 * c)]
    out = torch.stack(slots, dim=-1)  # [K/2, NC, P, 2c], slot o = (row o // c, sub-chunk o % c)
    out = out.reshape(k // 2, n // (c * tile_p), tile_p, 2, c).permute(0, 3, 1, 2, 4)
    return out.reshape(k, n)


def _check_geometry(k: int, n: int, num_bits: int, tile_p: int) -> None:
    if num_bits not in SUPPORTED_BITS:
        raise NotImplementedError(
            f"FLUTE {num_bits}-bit packing is not supported; supported: {SUPPORTED_BITS}"
        )
    if num_bits == 3:
        flute_bitplanes.check_geometry(k, n, tile_p)
        return
    if tile_p not in TILE_PS:
        raise ValueError(f"FLUTE tile_p must be one of {TILE_PS}, got {tile_p}")
    chunk = WORD_BITS // num_bits * tile_p
    if k % 2 or n % chunk:
        raise ValueError(
            f"FLUTE {num_bits}-bit packing with tile_p={tile_p} needs an even K and N a multiple "
            f"of {chunk}, got K={k}, N={n}"
        )


def flute_permutation(k: int, n: int, num_bits: int, tile_p: int) -> Integer[Tensor, " kn"]:
    """``perm`` with ``shuffled.flatten() == codes.flatten()[perm]`` for ``[K, N]`` codes (2 and
    4 bits, whose codes stay whole within a word)."""
    if num_bits == 3:
        raise ValueError(
            "3-bit FLUTE codes are split across 16-bit words, so no permutation of whole codes "
            "describes their packing; use pack_flute / unpack_flute"
        )
    _check_geometry(k, n, num_bits, tile_p)
    return _shuffle(torch.arange(k * n).reshape(k, n), num_bits, tile_p).reshape(-1)


def pack_flute(codes: Integer[Tensor, "k n"], num_bits: int, tile_p: int) -> Int16[Tensor, "w k"]:
    """Pack ``[K, N]`` codes in ``[0, 2**b)`` into FLUTE's int16 ``[N*b/16, K]`` layout."""
    k, n = codes.shape
    _check_geometry(k, n, num_bits, tile_p)
    values = codes.to(torch.int64)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << num_bits):
        raise ValueError(f"FLUTE codes must lie in [0, {1 << num_bits}) for {num_bits}-bit weights")
    if num_bits == 3:
        return flute_bitplanes.pack_3bit(values)
    fields = _shuffle(values, num_bits, tile_p).reshape(-1, WORD_BITS // num_bits)
    shifts = torch.arange(0, WORD_BITS, num_bits, device=codes.device)
    words = (fields << shifts).sum(-1)
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    return words.reshape(k, -1).T.contiguous()


def unpack_flute(
    data: Int16[Tensor, "w k"], n: int, num_bits: int, tile_p: int
) -> Integer[Tensor, "k n"]:
    """Inverse of :func:`pack_flute`: the ``[K, N]`` codes (int64)."""
    k = data.shape[1]
    _check_geometry(k, n, num_bits, tile_p)
    if num_bits == 3:
        return flute_bitplanes.unpack_3bit(data, n)
    words = data.T.reshape(-1, 1).to(torch.int64) & 0xFFFF
    shifts = torch.arange(0, WORD_BITS, num_bits, device=data.device)
    fields = ((words >> shifts) & ((1 << num_bits) - 1)).reshape(-1)
    perm = flute_permutation(k, n, num_bits, tile_p).to(data.device)
    codes = torch.empty_like(fields)
    codes[perm] = fields
    return codes.reshape(k, n)


def tables2_from_grid(
    grid: Float[Tensor, "points p"], num_bits: int
) -> Float[Tensor, "codes codes 2"]:
    """FLUTE's pair table from a HIGGS grid (``p`` = 2: ``2**(2b)`` points, 1: ``2**b``).

    Returned in the grid's dtype (the dtype whose bits the kernel reads).
    """
    size = 1 << num_bits
    if grid.shape == (size * size, 2):
        return grid.reshape(size, size, 2)
    if grid.shape == (size, 1):
        values = grid.reshape(size)
        return torch.stack(torch.broadcast_tensors(values[:, None], values[None, :]), dim=-1)
    raise ValueError(
        f"a {num_bits}-bit HIGGS grid must be [{size * size}, 2] (p=2) or [{size}, 1] (p=1), got "
        f"{list(grid.shape)}"
    )


def split_vector_codes(codes: Integer[Tensor, "n kv"], num_bits: int, p: int) -> Tensor:
    """HIGGS vector codes ``[N, Kp/p]`` to per-element codes ``[Kp, N]`` (FLUTE's input).

    For p = 2 each code ``c`` covers two consecutive weights: ``(c >> b, c & (2**b - 1))``.
    """
    if p == 1:
        return codes.T.to(torch.int64)
    if p != 2:
        raise ValueError(f"HIGGS vector dimension p must be 1 or 2, got {p}")
    mask = (1 << num_bits) - 1
    c = codes.to(torch.int64)
    return torch.stack([(c >> num_bits) & mask, c & mask], dim=-1).reshape(c.shape[0], -1).T


def hadamard_blocks(x: Float[Tensor, "*rows k"], size: int) -> Float[Tensor, "*rows k"]:
    """Unnormalised Sylvester Hadamard transform of each ``size``-block of the last dim."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"the Hadamard size must be a power of two, got {size}")
    if x.shape[-1] % size:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of {size}")
    lead = x.shape[:-1]
    y = x.reshape(-1, size)
    h = 1
    while h < size:
        pairs = y.reshape(-1, size // (2 * h), 2, h)
        y = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], dim=2)
        h *= 2
    return y.reshape(*lead, -1)


def _layout_int(payload: QuantPayload, key: str) -> int:
    value = payload.layout.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"higgs payload needs layout[{key!r}] (an int), got {value!r}")
    return value


@register_dequantizer("higgs")
def dequantize_higgs(payload: QuantPayload, dtype: torch.dtype) -> Float[Tensor, "out in"]:
    """Reconstruct a HIGGS weight in float32 (see the module docstring), then cast to ``dtype``."""
    if not dtype.is_floating_point:
        raise ValueError(f"HIGGS weights dequantize to a float dtype, not {dtype}")
    if len(payload.shape) != 2:
        raise ValueError(f"higgs payload shape must be [out, in], got {list(payload.shape)}")
    n, k = payload.shape
    bits, group = payload.format.bits, payload.format.block[1]
    tile_p, had = _layout_int(payload, "tile_p"), _layout_int(payload, "hadamard_size")
    if had % group:
        raise ValueError(f"hadamard_size {had} must be a multiple of the group size {group}")
    k_pad = ceil_div(k, had) * had
    require_dtype(payload.data, "data", (torch.int16,), payload)
    require_shape(payload.data, "data", (n * bits // WORD_BITS, k_pad), payload)
    scales = require_tensor(payload.scales, "scales", payload)
    require_dtype(scales, "scales", TABLE_DTYPES, payload)
    require_shape(scales, "scales", (n, k_pad // group), payload)
    require_finite(scales, "scales", payload)
    tables2 = require_tensor(payload.extras.get("tables2"), "extra.tables2", payload)
    require_dtype(tables2, "extra.tables2", TABLE_DTYPES, payload)
    size = 1 << bits
    require_shape(tables2, "extra.tables2", (size, size, 2), payload)
    require_same_device(payload)
    table = tables2.view(scales.dtype).float()  # reinterpret the bits as the scales' dtype
    require_finite(table, "extra.tables2", payload)
    codes = unpack_flute(payload.data, n, bits, tile_p)  # [Kp, N]
    pairs = codes.reshape(k_pad // 2, 2, n)
    values = table[pairs[:, 0], pairs[:, 1]]  # [Kp/2, N, 2]
    rotated = values.permute(1, 0, 2).reshape(n, k_pad)
    rotated = rotated * scales.float().repeat_interleave(group, dim=1)
    weight = hadamard_blocks(rotated, had) / math.sqrt(had)
    return weight[:, :k].to(dtype)
