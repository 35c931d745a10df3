"""Adopting transformers BitLinear / AutoBitLinear: dequantized payload == the module's math."""

import torch
from transformers.integrations import bitnet as hf_bitnet

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.bitnet import dequantize_bitnet

hf_unpack = hf_bitnet.unpack_weights._torchdynamo_orig_callable


def test_bitlinear_divides_by_weight_scale():
    gen = torch.Generator().manual_seed(0)
    ternary = torch.randint(-1, 2, (8, 16), generator=gen)
    module = hf_bitnet.BitLinear(16, 8, bias=False, dtype=torch.float32)
    module.weight.copy_(hf_bitnet.pack_weights(ternary.clone()))
    module.weight_scale.fill_(2.5)
    before = module.weight.clone()
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.global_scale == "divide"
    expected = hf_unpack(module.weight, torch.float32) / module.weight_scale
    assert torch.equal(dequantize_bitnet(payload, torch.float32), expected)
    assert torch.equal(module.weight, before)


def test_offline_autobitlinear_multiplies_and_online_is_not_quantized():
    gen = torch.Generator().manual_seed(1)
    module = hf_bitnet.AutoBitLinear(16, 8, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randint(-1, 2, (8, 16), generator=gen).to(torch.bfloat16))
        module.weight_scale.fill_(0.75)
    payload = adopt_module(module)
    assert payload.format.global_scale == "multiply"
    expected = module.weight.float() * module.weight_scale.float()
    assert torch.equal(dequantize_bitnet(payload, torch.float32), expected)
    online = hf_bitnet.AutoBitLinear(16, 8, bias=False, online_quant=True)
    assert not is_quantized_module(online)
