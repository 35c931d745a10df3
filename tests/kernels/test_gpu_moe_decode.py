"""The fused MoE decode (packed 4-bit and block FP8 experts) compiled for a real GPU (skipped
without CUDA): a Qwen3-30B-A3B-like block (64 experts, hidden 2048, moe_intermediate 768,
top-8) and a GPT-OSS-like one (32 experts, hidden and intermediate 2880, top-4, clamped
SwiGLU, biases), against the unfused launches it replaces and a float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import rel_err, scheme_id

from qlens.kernels.experts import experts_plan_for
from qlens.kernels.runtime import interpreting
from qlens.modules.dispatch import fused_experts_forward
from qlens.modules.expert_gate import ExpertGate
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]
SCHEMES = (
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 32, "asymmetric": True}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("fp8-block", {}),
)
QWEN3 = (64, 2048, 768, 8, ExpertGate("stacked", "silu"), False)
GPT_OSS = (32, 2880, 2880, 4, ExpertGate("interleaved", "clamped_swiglu", 1.702, 7.0), True)
# bf16 activations and weights round at 2**-9 relative, as do the outputs.
BF16_TOLERANCE = 8e-3


@pytest.mark.parametrize("tokens", (1, 4))
@pytest.mark.parametrize("block", (QWEN3, GPT_OSS), ids=("qwen3", "gpt-oss"))
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_fused_decode_on_gpu(scheme, block, tokens):
    experts, hidden, inner, top_k, gate, has_bias = block
    name, options = scheme
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    w1 = torch.randn(experts, 2 * inner, hidden, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inner, generator=gen) * 0.02
    first = quantize_weight(w1.to(dev), name, **options)
    down = quantize_weight(w2.to(dev), name, **options)
    plans = experts_plan_for(first, dev), experts_plan_for(down, dev)
    x = torch.randn(tokens, hidden, generator=gen).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[0, -1] = -1  # a skipped route
    ids = ids.to(dev)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(dev, torch.bfloat16)
    biases = (None, None)
    if has_bias:
        biases = (
            (torch.randn(experts, 2 * inner, generator=gen) * 0.1).to(dev, torch.bfloat16),
            (torch.randn(experts, hidden, generator=gen) * 0.1).to(dev, torch.bfloat16),
        )
    args = (x, ids, weights, *plans, *biases, gate.apply, None)
    fused = fused_experts_forward(*args, gate.kernel_rule)
    assert any(v is not None for v in plans[0]._fused.values())
    unfused = fused_experts_forward(*args, None)
    # The same roundings; the GPU's exp and the sums' order may move a value by one bf16 step.
    torch.testing.assert_close(fused, unfused, rtol=2**-7, atol=2**-7 * unfused.abs().max().item())
    d1, d2 = dequantize(first, torch.float64), dequantize(down, torch.float64)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64, device=dev)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = d1[e] @ x[t].double() + (biases[0][e].double() if has_bias else 0)
            y = d2[e] @ gate.apply(gu) + (biases[1][e].double() if has_bias else 0)
            ref[t] += float(weights[t, j]) * y
    assert rel_err(fused, ref) < BF16_TOLERANCE
