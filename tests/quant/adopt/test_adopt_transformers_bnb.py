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


def test_int8_after_first_forward_never_serves_codes(checkpoint):
    """bitsandbytes moves the int8 row scales (SCB) from the weight to the module's state on the
    first forward; qlens reads them there, so dequantized weights stay the real ones."""
    import qlens
    from qlens.weights import W_O, W_Q, process_weights

    model = LlamaForCausalLM.from_pretrained(
        checkpoint, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
    )
    attn = model.model.layers[0].self_attn
    expected = {
        name: bnb_functional.int8_vectorwise_dequant(m.weight.data, m.weight.SCB)
        for name, m in (("q", attn.q_proj), ("o", attn.o_proj))
    }
    bridge = qlens.load(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = bridge(ids)
        assert attn.q_proj.weight.SCB is None and attn.q_proj.state.SCB is not None  # moved
        assert torch.equal(bridge(ids), before)
    assert torch.equal(dequantize(attn.q_proj), expected["q"])
    with pytest.raises(NotImplementedError, match="integer dtype torch.int8"):
        W_Q(bridge, 0)
    with bridge.dequantized():
        w_q, w_o = W_Q(bridge, 0), W_O(bridge, 0)
    # [out, in] -> [head, d_model, d_head] and [in, out] -> [head, d_head, d_model]
    assert torch.equal(w_q, expected["q"].reshape(4, 16, 64).transpose(1, 2))
    assert torch.equal(w_o, expected["o"].T.reshape(4, 16, 64))
    processed = process_weights(
        bridge, fold_ln=False, center_unembed=False, fold_value_biases=False, dequantize=True
    ).bridge
    float_q = processed.model.model.layers[0].self_attn.q_proj
    assert type(float_q) is torch.nn.Linear
    assert torch.equal(float_q.weight.float(), expected["q"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_families_4bit(tmp_path, family):
    """bitsandbytes quantizes the MoE families' linears (attention) and leaves the fused 3-D
    experts in float; qlens adopts the former, keeps their own forward and reads the latter."""
    import transformers

    import qlens
    from qlens.report.audit import audit_weights
    from qlens.weights import W_Q

    sizes = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=1,
    )  # fmt: skip
    config, model_class = {
        "qwen3_moe": (
            transformers.Qwen3MoeConfig(
                **sizes, moe_intermediate_size=64, num_experts=2, mlp_only_layers=[]
            ),
            transformers.Qwen3MoeForCausalLM,
        ),
        "mixtral": (
            transformers.MixtralConfig(**sizes, num_local_experts=2),
            transformers.MixtralForCausalLM,
        ),
        "gpt_oss": (
            transformers.GptOssConfig(**sizes, num_local_experts=2),
            transformers.GptOssForCausalLM,
        ),
    }[family]
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    model = model_class.from_pretrained(
        tmp_path,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
        device_map="cpu",
    )
    quantized = {name: m for name, m in model.named_modules() if is_quantized_module(m)}
    assert sorted(quantized) == sorted(
        f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v", "o")
    )
    for module in quantized.values():
        weight = module.weight
        expected = bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
        assert torch.equal(dequantize(module, expected.dtype), expected)
    bridge = qlens.load(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert bridge.rerouted == [] and torch.equal(bridge(ids), model(ids).logits)
    with pytest.raises(NotImplementedError, match="quantization: bitsandbytes"):
        W_Q(bridge, 0)
    rows = audit_weights(model).rows
    assert {r.format for r in rows if not r.readable} == {"bnb_nf4"}
    experts = [r for r in rows if ".experts." in r.name and r.name.endswith("_proj")]
    assert experts and all(r.readable for r in experts)
