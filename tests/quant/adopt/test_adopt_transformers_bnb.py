"""bitsandbytes models loaded through transformers (BitsAndBytesConfig, CPU): every quantized
linear is adopted and equals bitsandbytes' dequantization of it."""

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from qlens.quant.adopt import adopt_module, is_quantized_module  # noqa: E402
from qlens.quant.dequantize import dequantize  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "config",
    [
        BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
        ),
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
        BitsAndBytesConfig(load_in_8bit=True),
    ],
    ids=["nf4-nested", "fp4", "int8"],
)
def test_every_quantized_linear_is_adopted(checkpoint, config):
    model = LlamaForCausalLM.from_pretrained(
        checkpoint, quantization_config=config, device_map="cpu"
    )
    quantized = {name: m for name, m in model.named_modules() if is_quantized_module(m)}
    assert sorted(quantized) == sorted(
        f"model.layers.0.{part}"
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )  # fmt: skip
    for module in quantized.values():
        weight = module.weight
        if config.load_in_4bit:
            expected = bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
        else:
            expected = bnb_functional.int8_vectorwise_dequant(weight.data, weight.SCB)
        assert torch.equal(dequantize(adopt_module(module), expected.dtype), expected)
