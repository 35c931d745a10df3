"""Block FP8 and GPT-OSS MXFP4 checkpoints written by qlens, loaded back by transformers.

transformers dequantizes both at load time (``dequantize=True``); qlens' payloads must give the
very same tensors. Ragged FP8 shapes are compared with transformers' ``_dequantize_fp8_weight``
because its load-time path infers the block from the scale grid and is wrong for them.
"""

import pytest
import torch
from safetensors.torch import save_file

from qlens.quant.codecs.fp8 import pack_fp8_block
from qlens.quant.codecs.mx import mxfp4_from_gpt_oss, mxfp4_to_gpt_oss
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

transformers = pytest.importorskip("transformers")
finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def test_fp8_block_checkpoint_loads_to_the_same_weights(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    payloads = {}
    for name in [n for n in state if n.endswith("proj.weight")]:
        payloads[name] = quantize_weight(state[name] * 0.02, "fp8-block")
        state[name] = payloads[name].data
        state[name.replace(".weight", ".weight_scale_inv")] = payloads[name].scales
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    config.quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    config.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
    )
    for name, payload in payloads.items():
        loaded = model.get_parameter(name)
        assert torch.equal(loaded, dequantize(payload, loaded.dtype)), name


@pytest.mark.parametrize("scale_dtype", ["fp32", "e8m0"])
@pytest.mark.parametrize("shape", [(200, 300), (3, 130, 257), (128, 128)])
def test_ragged_fp8_blocks_match_transformers_reference(shape, scale_dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    payload = quantize_weight(w, "fp8-block", scale_dtype=scale_dtype)
    scales = payload.scales
    if scale_dtype == "e8m0":
        scales = scales.view(torch.float8_e8m0fnu)  # how transformers holds UE8M0 scales
    # In bf16 transformers rounds fp32 scales to bf16 before multiplying (two roundings);
    # qlens multiplies in fp32 and rounds once, so bf16 is compared only for E8M0 scales,
    # which bf16 holds exactly.
    dtypes = (torch.float32, torch.bfloat16) if scale_dtype == "e8m0" else (torch.float32,)
    for dtype in dtypes:
        theirs = finegrained_fp8._dequantize_fp8_weight(payload.data, scales, [128, 128], dtype)
        assert torch.equal(dequantize(payload, dtype), theirs)
    same = pack_fp8_block(payload.data, scales, block=(128, 128))  # e8m0 view accepted
    assert torch.equal(dequantize(same), dequantize(payload))


def test_gpt_oss_mxfp4_checkpoint_loads_to_the_same_experts(tmp_path):
    config = transformers.GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    state = transformers.GptOssForCausalLM(config).state_dict()
    payloads = {}
    for proj in ("gate_up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{proj}"
        # HF's experts are [E, in, out]; the checkpoint stores [E, out, in/32, 16] blocks
        weight = state.pop(key).transpose(1, 2).contiguous() * 0.02
        payloads[key] = quantize_weight(weight, "mxfp4")
        blocks, scales = mxfp4_to_gpt_oss(payloads[key])
        assert blocks.shape == (*weight.shape[:2], weight.shape[2] // 32, 16)
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        again = mxfp4_from_gpt_oss(blocks, scales)
        assert torch.equal(again.data, payloads[key].data)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.bfloat16,
    )
    for key, payload in payloads.items():
        loaded = model.get_parameter(key)
        assert torch.equal(loaded, dequantize(payload, loaded.dtype).transpose(1, 2)), key
