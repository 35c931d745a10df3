"""No false positives: float models hold no module that adopt considers quantized."""

import torch
from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

from qlens.quant.adopt import is_quantized_module


def test_float_llama_and_gpt_oss_have_no_quantized_modules():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2,
        )
    )  # fmt: skip
    gpt_oss = GptOssForCausalLM(
        GptOssConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
            num_experts_per_tok=1, head_dim=8,
        )
    )  # fmt: skip
    for model in (llama, gpt_oss):
        flagged = [name for name, m in model.named_modules() if is_quantized_module(m)]
        assert flagged == []
