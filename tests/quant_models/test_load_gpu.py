"""Quantize-on-load on a CUDA GPU (skipped without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import input_ids, make_model

import qlens
from qlens.kernels.runtime import interpreting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]


@pytest.mark.parametrize(("family", "scheme"), [("llama", "int4"), ("qwen3_moe", "mxfp4")])
def test_quantize_on_load_on_the_gpu_equals_quantize_after_load(
    tmp_path: Path, family: str, scheme: str
) -> None:
    make_model(family).save_pretrained(tmp_path, max_shard_size="100KB")
    streamed = qlens.load(tmp_path, quantize=scheme, dtype=torch.bfloat16, device="cuda").model
    reference = qlens.quantize(
        qlens.load(tmp_path, dtype=torch.bfloat16, device="cuda").model, scheme
    )
    before, after = reference.state_dict(), streamed.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert after[key].device.type == "cuda", key
        assert torch.equal(after[key], value), key
    ids = input_ids().cuda()
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, reference(ids).logits)
