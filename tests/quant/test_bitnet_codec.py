"""BitNet ternary packing and dequantization against transformers' integrations/bitnet.py."""

import pytest
import torch
from transformers.integrations import bitnet as hf_bitnet

from qlens.quant.codecs.bitnet import (
    bitnet_format,
    dequantize_bitnet,
    pack_ternary,
    unpack_ternary,
)
from qlens.quant.payload import QuantPayload

# transformers wraps unpack_weights in torch.compile; the oracle is the undecorated function.
hf_unpack = hf_bitnet.unpack_weights._torchdynamo_orig_callable


def _ternary(rows, cols, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, (rows, cols), generator=gen).to(torch.int8)


@pytest.mark.parametrize("rows", [8, 12, 6, 1])
def test_pack_matches_transformers(rows):
    ternary = _ternary(rows, 5)
    expected = hf_bitnet.pack_weights(ternary.clone().to(torch.int16))
    packed = pack_ternary(ternary)
    if rows % 4 == 0:
        assert torch.equal(packed, expected)
    else:
        # transformers leaves padding rows at code 0 (= -1); qlens pads with code 1 (= 0).
        # Only the rows that hold real weights are compared.
        got = unpack_ternary(packed, rows)
        assert torch.equal(got, hf_unpack(expected, torch.int8)[:rows])
    assert torch.equal(unpack_ternary(packed, rows), ternary)


def test_unpack_matches_transformers_on_random_bytes():
    gen = torch.Generator().manual_seed(1)
    stored = torch.randint(0, 3, (4, 3, 7), generator=gen).to(torch.uint8)
    packed = stored[0] | (stored[1] << 2) | (stored[2] << 4) | (stored[3] << 6)
    assert torch.equal(unpack_ternary(packed, 12), hf_unpack(packed, torch.int8))


@pytest.mark.parametrize("convention", ["divide", "multiply"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_conventions(convention, dtype):
    ternary = _ternary(8, 16, seed=2)
    scale = torch.tensor([0.37], dtype=dtype)
    payload = QuantPayload(
        bitnet_format(convention), pack_ternary(ternary), (8, 16), global_scale=scale
    )
    got = dequantize_bitnet(payload, dtype)
    t = hf_unpack(hf_bitnet.pack_weights(ternary.clone()), torch.float32)
    s = scale.float()
    expected = t / s if convention == "divide" else t * s
    assert torch.equal(got, expected.to(dtype))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="must be ternary"):
        pack_ternary(torch.tensor([[2, 0]]))
    with pytest.raises(ValueError, match="invalid 2-bit code 3"):
        unpack_ternary(torch.full((1, 2), 0xFF, dtype=torch.uint8), 4)
    packed = pack_ternary(_ternary(8, 4))
    with pytest.raises(ValueError, match="`global_scale` is missing"):
        dequantize_bitnet(QuantPayload(bitnet_format("divide"), packed, (8, 4)), torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale\) is 0"):
        dequantize_bitnet(
            QuantPayload(bitnet_format("divide"), packed, (8, 4), global_scale=torch.zeros(1)),
            torch.float32,
        )
    with pytest.raises(ValueError, match=r"`data` must have shape \[3, 4\]"):
        dequantize_bitnet(
            QuantPayload(bitnet_format("divide"), packed, (12, 4), global_scale=torch.ones(1)),
            torch.float32,
        )
    with pytest.raises(ValueError, match="'divide' \\(BitLinear\\) or 'multiply'"):
        bitnet_format("inverse")


def test_registered_in_the_dequantizer_registry():
    from qlens.quant.codecs.registry import dequantizer_for

    assert dequantizer_for("bitnet") is dequantize_bitnet
