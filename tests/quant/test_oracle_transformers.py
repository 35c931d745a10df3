"""Block FP8 and GPT-OSS MXFP4 checkpoints written by qlens, loaded back by transformers.

transformers dequantizes both at load time (``dequantize=True``); qlens' payloads must give the
very same tensors. Ragged FP8 shapes are compared with transformers' ``_dequantize_fp8_weight``
because its load-time path infers the block from the scale grid and is wrong for them.
"""

import pytest
import torch
from transformers_checkpoints import write_fp8_block_checkpoint, write_gpt_oss_mxfp4_checkpoint

from qlens.quant.codecs.fp8 import pack_fp8_block
from qlens.quant.codecs.mx import mxfp4_from_gpt_oss, mxfp4_to_gpt_oss
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

transformers = pytest.importorskip("transformers")
finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def test_fp8_block_checkpoint_loads_to_the_same_weights(tmp_path):
    payloads = write_fp8_block_checkpoint(tmp_path)
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
    payloads = write_gpt_oss_mxfp4_checkpoint(tmp_path)
    for payload in payloads.values():
        blocks, scales = mxfp4_to_gpt_oss(payload)
        e, n, k = payload.shape
        assert blocks.shape == (e, n, k // 32, 16)
        assert torch.equal(mxfp4_from_gpt_oss(blocks, scales).data, payload.data)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.bfloat16,
    )
    for key, payload in payloads.items():
        loaded = model.get_parameter(key)
        assert torch.equal(loaded, dequantize(payload, loaded.dtype).transpose(1, 2)), key
