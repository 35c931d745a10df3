"""Eager decode calls of the quantized modules on a real GPU: after the first call each linear
launches directly, with no new launch key, bit-equal to the normal launch (skipped without
CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model

from qlens.kernels.experts import ExpertsPlan
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.fp8_w8a8 import _ACT_QUANT, _FP8_BLOCK_GEMM
from qlens.kernels.gemv import _GEMV, PACKED_GEMV
from qlens.kernels.runtime import interpreting
from qlens.kernels.weight_only import _WEIGHT_ONLY
from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]

LAUNCHERS = (PACKED_GEMV, _GEMV, _WEIGHT_ONLY, _ACT_QUANT, _FP8_BLOCK_GEMM)
SCHEMES = (
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 128, "asymmetric": True}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("fp8-block", {}),
    ("int8", {}),
)


def _keys() -> int:
    return sum(len(launcher.cached_keys()) for launcher in LAUNCHERS)


def _normal_launches(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call()`` with every launch through Triton's ``JITFunction.run``."""
    FastLaunch.direct = False
    try:
        return call()
    finally:
        FastLaunch.direct = True


@pytest.mark.parametrize("rows", (1, 16))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s[0] + "".join(f"-{v}" for v in s[1]))
def test_quant_linear_decode_launches_directly_after_the_first_call(scheme, rows) -> None:
    torch.manual_seed(0)
    name, options = scheme
    payload = quantize_weight(torch.randn(2304, 4096), name, **options)
    module = QuantLinear(payload, torch.randn(2304)).to("cuda")
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    normal = _normal_launches(lambda: module(x))
    first = module(x)
    keys = _keys()
    assert keys >= 1, "the call did not go through the launchers"
    for _ in range(3):
        assert torch.equal(module(x), normal)
    assert torch.equal(first, normal) and _keys() == keys  # no launch key missed
    weight = dequantize(module.payload, torch.float64)
    expected = F.linear(x.double(), weight, module.bias.double())
    assert ((first.double() - expected).norm() / expected.norm()).item() < 8e-3


def test_quant_experts_decode_launches_directly_after_the_first_call(monkeypatch) -> None:
    torch.manual_seed(0)
    model = quantize(make_model("qwen3_moe"), "int4")
    experts = model.get_submodule("model.layers.0.mlp.experts").to("cuda")
    assert isinstance(experts, QuantExperts)
    x = torch.randn(1, experts.hidden_dim, device="cuda")
    index = torch.tensor([[2, 0]], device="cuda")
    weights = torch.tensor([[0.7, 0.3]], device="cuda")
    assert experts.experts_plan("gate_up", x).one_launch(2)
    with torch.no_grad():
        normal = _normal_launches(lambda: experts(x, index, weights))
        first = experts(x, index, weights)
        keys = _keys()
        for _ in range(3):
            assert torch.equal(experts(x, index, weights), normal)
        assert torch.equal(first, normal) and _keys() == keys
        monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: False)
        loop = experts(x, index, weights)  # expert by expert
    torch.testing.assert_close(first, loop, atol=1e-4, rtol=1e-4)
