"""Adopting transformers' HiggsLinear (built on CPU; its forward needs FLUTE on CUDA) and its
GgufLinear / GgufEmbedding / GgufExperts (filled with blocks quantized by gguf-py)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.integrations.gguf.utils import GgufEmbedding, GgufExperts, GgufLinear
from transformers.integrations.higgs import HiggsLinear

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.higgs import dequantize_higgs, pack_flute, tables2_from_grid
from qlens.quant.codecs.registry import dequantizer_for


@pytest.mark.parametrize("bits,n", [(4, 256), (3, 512)])
def test_higgs_linear(bits, n):
    gen = torch.Generator().manual_seed(0)
    size = 1 << bits
    codes = torch.randint(0, size, (128, n), generator=gen)  # [K, N] per-element codes
    grid = torch.randn(size * size, 2, generator=gen).to(torch.bfloat16)
    scales = (torch.rand(n, 4, generator=gen) * 0.01).to(torch.bfloat16)
    module = HiggsLinear(
        128, n, num_bits=bits, bias=False, dtype=torch.bfloat16, group_size=32, hadamard_size=64
    )
    # As after transformers' loading: FLUTE-packed weight for the template chosen at tuning
    # (template 20 of the 4-bit table and 8 of the 2/3-bit one have TileP 32), the grid's bf16
    # bits labelled float16.
    module.weight.data = pack_flute(codes, bits, 32)
    module.scales.data = scales
    module.tables2.data = tables2_from_grid(grid, bits).view(torch.float16)
    module.tune_metadata = SimpleNamespace(template_id=20 if bits == 4 else 8)
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.layout == {"packing": "flute", "tile_p": 32, "hadamard_size": 64}
    got = dequantize_higgs(payload, torch.float32)
    # Independent reconstruction: pair lookup, scale, 64-point Sylvester Hadamard / 8.
    h = torch.ones(1, 1)
    while h.shape[0] < 64:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    pairs = grid.float().reshape(size, size, 2)[codes[0::2], codes[1::2]]  # [K/2, N, 2]
    values = pairs.permute(1, 0, 2).reshape(n, 128) * scales.float().repeat_interleave(32, 1)
    expected = (values.reshape(n, 2, 64) @ h).reshape(n, 128) / 8
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    module.tune_metadata = None
    with pytest.raises(ValueError, match="no tune_metadata.template_id"):
        adopt_module(module)


def _gguf_blocks(gguf, shape, qtype, seed):
    weight = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(gguf.quants.dequantize(blocks, qtype))


@pytest.mark.parametrize("with_permutation", [False, True])
def test_gguf_linear(with_permutation):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType.Q4_1
    blocks, plain = _gguf_blocks(gguf, (8, 64), qtype, 0)
    module = GgufLinear(64, 8, int(qtype))
    module.weight.data = blocks
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    if with_permutation:
        module.input_permutation = perm
    assert is_quantized_module(module)
    got = dequantizer_for("gguf_q4_1")(adopt_module(module), torch.float32)
    if with_permutation:
        # GgufLinear's forward is x.index_select(1, perm) @ W_blocks.T, so W[:, perm] = W_blocks.
        assert torch.equal(got[:, perm], plain)
        x = torch.randn(2, 64)
        torch.testing.assert_close(x @ got.T, x.index_select(1, perm) @ plain.T)
    else:
        assert torch.equal(got, plain)
    module.ggml_type = 99
    with pytest.raises(ValueError, match="GGML type id 99 is not supported"):
        adopt_module(module)


def test_gguf_embedding_and_experts():
    gguf = pytest.importorskip("gguf")
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    table, table_plain = _gguf_blocks(gguf, (10, 32), q8, 1)
    embedding = GgufEmbedding(10, 32, int(q8))
    embedding.weight.data = table
    assert torch.equal(
        dequantizer_for("gguf_q8_0")(adopt_module(embedding), torch.float32), table_plain
    )

    experts = GgufExperts(2, 64, 32, int(q8), int(q4), act_fn=torch.nn.SiLU())
    gate_up, gate_up_plain = _gguf_blocks(gguf, (2, 64, 64), q8, 2)
    down, down_plain = _gguf_blocks(gguf, (2, 64, 32), q4, 3)
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    payloads = adopt_module(experts)
    assert payloads["gate_up_proj"].layout["gate_up"] == "stacked"
    assert torch.equal(
        dequantizer_for("gguf_q8_0")(payloads["gate_up_proj"], torch.float32), gate_up_plain
    )
    assert torch.equal(
        dequantizer_for("gguf_q4_0")(payloads["down_proj"], torch.float32), down_plain
    )
