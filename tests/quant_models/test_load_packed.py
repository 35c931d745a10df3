"""FP8-block and GPT-OSS MXFP4 checkpoints load packed through `qlens.load` on the CPU, where
transformers would dequantize them. Checkpoints are written in transformers' documented on-disk
layout (transformers writes neither format on a CPU): FP8 ``weight`` e4m3 + ``weight_scale_inv``
per 128 x 128 block; GPT-OSS ``*_blocks [E, N, K/32, 16]`` / ``*_scales [E, N, K/32]``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import qlens
from qlens.quant.codecs.mx import mxfp4_to_gpt_oss
from qlens.quant.modules import QuantExperts, QuantLinear
from qlens.quant.quantize import quantize_weight

transformers = pytest.importorskip("transformers")
TOKENS = torch.tensor([[1, 5, 9, 2, 17, 3]])


def _fp8_checkpoint(path: Path) -> dict:
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    payloads = {}
    for name in [n for n in state if n.endswith("proj.weight")]:
        payloads[name] = quantize_weight(state[name] * 0.02, "fp8-block")
        state[name] = payloads[name].data
        state[name.replace(".weight", ".weight_scale_inv")] = payloads[name].scales
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    config.quantization_config = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }  # fmt: skip
    config.save_pretrained(path)
    return payloads


def _gpt_oss_checkpoint(path: Path) -> dict:
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    state = transformers.GptOssForCausalLM(config).state_dict()
    payloads = {}
    for proj in ("gate_up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{proj}"
        weight = state.pop(key).transpose(1, 2).contiguous() * 0.02
        payloads[key] = quantize_weight(weight, "mxfp4")
        state[f"{key}_blocks"], state[f"{key}_scales"] = mxfp4_to_gpt_oss(payloads[key])
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(path)
    return payloads


def test_fp8_block_linears_stay_packed(tmp_path: Path) -> None:
    payloads = _fp8_checkpoint(tmp_path)
    bridge = qlens.load(tmp_path, dtype=torch.float32)
    for name, payload in payloads.items():
        module = bridge.model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(module, QuantLinear), name
        assert torch.equal(module.payload.data.view(torch.uint8), payload.data.view(torch.uint8))
        assert torch.equal(module.payload.scales, payload.scales)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
    ).eval()
    for name in payloads:
        packed = bridge.model.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(qlens.dequantize(packed), reference.get_parameter(name)), name
    with torch.no_grad():
        ours, theirs = bridge(TOKENS), reference(TOKENS).logits
    # Same fp32 weights; the matmuls may sum in a different order.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    floats = qlens.load(tmp_path, dtype=torch.float32, dequantize=True)
    assert not any(isinstance(m, QuantLinear) for m in floats.model.modules())
    for name in payloads:
        assert torch.equal(floats.model.get_parameter(name), reference.get_parameter(name))


def test_gpt_oss_mxfp4_experts_stay_packed(tmp_path: Path) -> None:
    payloads = _gpt_oss_checkpoint(tmp_path)
    bridge = qlens.load(tmp_path, dtype=torch.bfloat16)
    experts = bridge.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.bfloat16,
    ).eval()
    for key, payload in payloads.items():
        prefix = "gate_up" if "gate_up" in key else "down"
        ours = qlens.dequantize(experts.payload_for(prefix), torch.bfloat16)
        assert torch.equal(ours, qlens.dequantize(payload, torch.bfloat16)), key
        assert torch.equal(ours.transpose(1, 2), reference.get_parameter(key)), key
    with torch.no_grad():
        ours_logits, theirs = bridge(TOKENS).float(), reference(TOKENS).logits.float()
    # bf16 activations: each path rounds its own intermediate sums to bf16.
    torch.testing.assert_close(
        ours_logits, theirs, rtol=0.05, atol=0.05 * theirs.abs().max().item()
    )


def test_incomplete_fp8_checkpoint_is_refused(tmp_path: Path) -> None:
    _fp8_checkpoint(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks tensors for model\.layers\.0\.mlp\.up_proj\.weight: .* no scales"
    ):
        qlens.load(tmp_path)
