"""On a CUDA device: the routed / shared-expert hooks of a quantized Qwen2-MoE model hold the
terms qlens' kernels compute, leave the logits bit-identical, and zeroing the shared term is the
model with its shared expert's output zeroed."""

from __future__ import annotations

import pytest
import torch
from kernel_route import count_kernel_route
from module_hooks import recording, replacing
from tiny_models import input_ids, make_model

from qlens.bridge import Bridge
from qlens.modules.model_quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROUTED, SHARED = "blocks.0.mlp.hook_routed_out", "blocks.0.mlp.hook_shared_expert_out"
MLP = "model.layers.0.mlp"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_shared_expert_hooks_hold_the_kernels_terms(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantized = quantize(make_model("qwen2_moe"), "int4")
    quantized.to("cuda")
    quantized.to(dtype)
    bridge, ids = Bridge(quantized), input_ids().cuda()
    calls = count_kernel_route(monkeypatch)
    terms = [f"{MLP}.experts", f"{MLP}.shared_expert", f"{MLP}.shared_expert_gate"]
    with torch.no_grad():
        with recording(quantized, terms) as own:  # the same forward as the cache's
            logits, cache = bridge.run_with_cache(ids, names_filter=[ROUTED, SHARED])
        expected = quantized(ids).logits
        zeroed = bridge.run_with_hooks(ids, fwd_hooks=[(SHARED, lambda x, hook: 0 * x)])
        with replacing(quantized, {f"{MLP}.shared_expert": torch.zeros_like}):
            expected_zeroed = quantized(ids).logits
    assert calls, "the CUDA forward did not use qlens' kernels"
    gated = torch.sigmoid(own[f"{MLP}.shared_expert_gate"]) * own[f"{MLP}.shared_expert"]
    assert cache[SHARED].dtype == dtype and cache[SHARED].device.type == "cuda"
    assert torch.equal(cache[SHARED], gated.reshape(*ids.shape, -1))
    assert torch.equal(cache[ROUTED], own[f"{MLP}.experts"].reshape(*ids.shape, -1))
    # deterministic kernels (split-K partials summed in order; two routes per token)
    assert torch.equal(logits, expected)
    assert torch.equal(zeroed, expected_zeroed) and not torch.equal(zeroed, logits)
