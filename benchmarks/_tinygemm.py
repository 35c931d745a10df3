"""torch's built-in int4 GEMM (tinygemm, ``aten._weight_int4pack_mm``) over the codes and scales
of a qlens int4 payload, as a peer in the kernel benchmarks.

qlens int4 stores ``w = (q - 8) * s`` with two codes per byte, the even column in the low nibble,
and float32 scales ``[N, K / group]``. tinygemm computes ``w = (q - 8) * scale + zero`` from
``scales_and_zeros [K / group, N, 2]`` (bf16); its CUDA packer takes ``uint8 [N, K / 2]`` with
the even column in the high nibble, its CPU packer ``int32 [N, K]`` codes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qlens.quant.payload import QuantPayload

# K-tiles per tinygemm tile (2, 4 or 8); 8 is what torch's int4 weight-only path uses for bf16.
INNER_K_TILES = 8


def int4_codes(p: QuantPayload) -> torch.Tensor:
    """The ``int32 [N, K]`` codes (0..15) of a symmetric qlens int4 payload whose shape tinygemm
    takes (``N`` a multiple of 8, ``K`` of ``16 * INNER_K_TILES``)."""
    n, k = p.shape
    if p.format.name != "int4" or p.zeros is not None:
        raise ValueError(f"tinygemm takes symmetric int4 payloads; got {p.format.name} "
                         f"{'with' if p.zeros is not None else 'without'} zero points")  # fmt: skip
    if n % 8 or k % (16 * INNER_K_TILES):
        raise ValueError(
            f"tinygemm needs N % 8 == 0 and K % {16 * INNER_K_TILES} == 0; got [{n}, {k}]"
        )
    return torch.stack((p.data & 0xF, p.data >> 4), dim=-1).view(n, k).to(torch.int32)


def scales_and_zeros(p: QuantPayload) -> torch.Tensor:
    """tinygemm's ``bf16 [K / group, N, 2]`` of the payload's scales, with zero offsets."""
    scales = p.scales.to(torch.bfloat16).t()
    return torch.stack((scales, torch.zeros_like(scales)), dim=-1).contiguous()


def group_size(p: QuantPayload) -> int:
    return p.shape[1] // p.scales.shape[1]


def cuda_packed(codes: torch.Tensor) -> torch.Tensor:
    """``uint8 [N, K / 2]`` with the even column in the high nibble: the CUDA packer's input."""
    return ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)


def tinygemm_int4(p: QuantPayload) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ w.T`` through tinygemm on ``p``'s device (CUDA, or the CPU kernel), for bf16
    ``x [M, K]``."""
    codes, sz, group = int4_codes(p), scales_and_zeros(p), group_size(p)
    if codes.is_cuda:
        w = torch.ops.aten._convert_weight_to_int4pack(cuda_packed(codes), INNER_K_TILES)
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, w, group, sz)
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)
