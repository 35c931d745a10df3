"""HIGGS / FLUTE codec. FLUTE decodes on CUDA only, so these tests check pack/unpack identity,
element placements derived by hand from FLUTE's ``_pack_4bit`` (``test_higgs_flute_oracle.py``
compares the packing with FLUTE's own packers), and dequantization against HIGGS' documented
quantize -> dequantize math (transformers' ``quantize_with_higgs``) evaluated independently in
float64 with an explicit Hadamard matrix."""

import math

import pytest
import torch
from transformers.integrations.higgs import get_higgs_grid

from qlens.quant.codecs.higgs import (
    dequantize_higgs,
    flute_permutation,
    flute_tile_p,
    hadamard_blocks,
    higgs_format,
    pack_flute,
    split_vector_codes,
    tables2_from_grid,
    unpack_flute,
)
from qlens.quant.payload import QuantPayload


@pytest.mark.parametrize(
    "bits,tile_p,n",
    [(4, 32, 128), (4, 64, 512), (3, 32, 512), (3, 32, 1024), (2, 32, 256), (2, 64, 512)],
)
def test_pack_unpack_identity(bits, tile_p, n):
    gen = torch.Generator().manual_seed(bits * tile_p)
    codes = torch.randint(0, 1 << bits, (6, n), generator=gen)
    packed = pack_flute(codes, bits, tile_p)
    assert packed.dtype == torch.int16 and packed.shape == (n * bits // 16, 6)
    assert torch.equal(unpack_flute(packed, n, bits, tile_p), codes)


def test_first_words_follow_flute_shuffle():
    # _pack_4bit with tile_P = 32 on C [2, 128]: output row 0, sub-chunk slot s takes pair row
    # 1 - s % 2, sub-chunk s // 2 (transposed within tile), so the first four nibbles of the
    # stream are C[1, 0], C[0, 0], C[1, 32], C[0, 32]; slots 4..7 (output row 1) continue with
    # sub-chunks 2 and 3: C[1, 64], C[0, 64], C[1, 96], C[0, 96].
    codes = (torch.arange(256) % 16).reshape(2, 128)
    codes[1] = 15 - codes[1]
    codes[0, 32], codes[1, 32], codes[0, 64], codes[1, 64] = 3, 9, 5, 6
    packed = pack_flute(codes, 4, 32).to(torch.int64) & 0xFFFF
    nibbles = [(int(packed[0, 0]) >> (4 * i)) & 0xF for i in range(4)]
    assert nibbles == [int(codes[1, 0]), int(codes[0, 0]), int(codes[1, 32]), int(codes[0, 32])]
    # Output row 1 starts after the 128 values of output row 0, i.e. at word 32 of the stream;
    # the stream is viewed [K, N/4] and transposed, so word 32 is data[0, 1].
    nibbles = [(int(packed[0, 1]) >> (4 * i)) & 0xF for i in range(4)]
    assert nibbles == [int(codes[1, 64]), int(codes[0, 64]), int(codes[1, 96]), int(codes[0, 96])]


def _sylvester(size: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_blocks_is_sylvester():
    x = torch.randn(3, 128, dtype=torch.float64)
    expected = (x.reshape(3, 2, 64) @ _sylvester(64)).reshape(3, 128)
    torch.testing.assert_close(hadamard_blocks(x, 64), expected, rtol=0, atol=1e-12)


def _higgs_quantize(w, hadamard_size, grid):
    """HIGGS p=2 quantization as documented: per row and block, s = ||w||, codes = nearest grid
    point of Had(w) / s, stored scale s / sqrt(H)."""
    n, k = w.shape
    blocks = w.double().reshape(n, k // hadamard_size, hadamard_size)
    norms = blocks.norm(dim=-1)
    rotated = (blocks @ _sylvester(hadamard_size)) / norms[..., None]
    pairs = rotated.reshape(n, -1, 2)
    g = grid.double()
    codes = (2 * pairs @ g.T - (g**2).sum(-1)).argmax(-1)
    return codes.reshape(n, -1), norms / math.sqrt(hadamard_size)


@pytest.mark.parametrize("bits,n", [(4, 128), (3, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_matches_documented_math(dtype, bits, n):
    k, hadamard_size, group, tile_p = 128, 64, 32, 32
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    grid = get_higgs_grid(2, 1 << (2 * bits)).to(dtype)
    codes, block_scales = _higgs_quantize(w, hadamard_size, grid)
    scales = block_scales.to(dtype).repeat_interleave(hadamard_size // group, dim=1)
    data = pack_flute(split_vector_codes(codes, bits, p=2), bits, tile_p)
    payload = QuantPayload(
        higgs_format(bits, group, dtype),
        data,
        (n, k),
        scales=scales,
        layout={"packing": "flute", "tile_p": tile_p, "hadamard_size": hadamard_size},
        # transformers stores the grid's bits under a float16 label whatever the model dtype.
        extras={"tables2": tables2_from_grid(grid, bits).view(torch.float16)},
    )
    got = dequantize_higgs(payload, torch.float32)
    values = grid.double()[codes].reshape(n, k // hadamard_size, hadamard_size)
    expected = (values @ _sylvester(hadamard_size)) / math.sqrt(hadamard_size)
    expected = (expected * scales.double()[:, ::2, None]).reshape(n, k)
    # float32 butterflies vs a float64 matrix product: agreement to float32 rounding of a
    # 64-term sum (weights are ~0.02, so 1e-8 absolute is ~1e-6 relative to their scale).
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-8)
    # and the round trip approximates the original weight as well as its bit width allows
    # (relative error ~0.10 at 4 bits, ~0.17 at 3 bits for Gaussian weights)
    assert (got - w).norm() / w.norm() < {4: 0.15, 3: 0.25}[bits]


def test_tile_p_table_and_errors():
    assert [flute_tile_p(4, i) for i in (0, 15, 16, 47, 48, 143)] == [64, 64, 32, 32, 64, 32]
    assert [flute_tile_p(2, i) for i in (3, 4, 12)] == [64, 32, 64]
    with pytest.raises(ValueError, match="no FLUTE template 144"):
        flute_tile_p(4, 144)
    with pytest.raises(NotImplementedError, match="HIGGS 5-bit weights are not supported"):
        higgs_format(5, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="tile_p=32 only"):
        pack_flute(torch.zeros(2, 512, dtype=torch.int64), 3, 64)
    with pytest.raises(ValueError, match="N a multiple of 512"):
        pack_flute(torch.zeros(2, 256, dtype=torch.int64), 3, 32)
    with pytest.raises(ValueError, match="N a multiple of 128"):
        pack_flute(torch.zeros(2, 64, dtype=torch.int64), 4, 32)
    with pytest.raises(ValueError, match="no permutation of whole codes"):
        flute_permutation(2, 512, 3, 32)
    codes = torch.zeros(2, 128, dtype=torch.int64)
    payload = QuantPayload(
        higgs_format(4, 32, torch.bfloat16),
        pack_flute(codes, 4, 32),
        (128, 2),
        scales=torch.ones(128, 2, dtype=torch.bfloat16),
        layout={"packing": "flute", "tile_p": 32},
        extras={"tables2": torch.zeros(16, 16, 2, dtype=torch.float16)},
    )
    with pytest.raises(ValueError, match="hadamard_size"):
        dequantize_higgs(payload, torch.float32)
    payload.layout["hadamard_size"] = 64
    with pytest.raises(ValueError, match=r"`data` must have shape \[32, 64\]"):
        dequantize_higgs(payload, torch.float32)


def test_two_bit_scalar_grid_p1():
    # HIGGS 2-bit uses p = 1: a 4-point scalar grid; tables2[a, b] = (grid[a], grid[b]).
    n, k, hadamard_size, group, bits, tile_p = 256, 64, 64, 64, 2, 32
    gen = torch.Generator().manual_seed(1)
    grid = get_higgs_grid(1, 4).to(torch.float16)
    codes = torch.randint(0, 4, (n, k), generator=gen)  # [N, K] scalar codes
    scales = (torch.rand(n, 1, generator=gen) * 0.01).to(torch.float16)
    payload = QuantPayload(
        higgs_format(bits, group, torch.float16),
        pack_flute(split_vector_codes(codes, bits, p=1), bits, tile_p),
        (n, k),
        scales=scales,
        layout={"packing": "flute", "tile_p": tile_p, "hadamard_size": hadamard_size},
        extras={"tables2": tables2_from_grid(grid, bits)},
    )
    got = dequantize_higgs(payload, torch.float32)
    values = grid.double().reshape(4)[codes]
    expected = (values @ _sylvester(hadamard_size)) / math.sqrt(hadamard_size) * scales.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-8)


def test_registered_in_the_dequantizer_registry():
    from qlens.quant.codecs.registry import dequantizer_for

    assert dequantizer_for("higgs") is dequantize_higgs
