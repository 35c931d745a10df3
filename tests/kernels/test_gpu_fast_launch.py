"""Direct launches of the decode kernels on a real GPU: the same results as their normal launch
and the reference, with fresh and misaligned inputs (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import quantized, rel_err

from qlens.kernels import LinearConfig, dequantize_triton, quantized_linear
from qlens.kernels.dequant import _DEQUANT
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.fp8_w8a8 import _ACT_QUANT, _FP8_BLOCK_GEMM
from qlens.kernels.gemv import _GEMV, PACKED_GEMV
from qlens.kernels.reference import reference_linear, reference_w8a8_linear
from qlens.kernels.runtime import interpreting
from qlens.kernels.weight_only import _WEIGHT_ONLY
from qlens.quant.dequantize import dequantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]

N, K = 2304, 4096
# (weight scheme, W8A8, rows, config, the launchers the call goes through)
LAUNCH_SITES = (
    (("int4", {"group_size": 128}), False, 1, LinearConfig("gemv", 16, 32, 1024), (PACKED_GEMV,)),
    (("nvfp4", {}), False, 1, LinearConfig("gemv", 16, 64, 256, split_k=2), (PACKED_GEMV,)),
    (("mxfp4", {}), False, 1, LinearConfig("gemv", 16, 64, 256), (PACKED_GEMV,)),
    (("int8", {"group_size": 64}), False, 1, LinearConfig("gemv", 16, 16, 512), (_GEMV,)),
    (("fp8-block", {}), False, 1, LinearConfig("gemv", 16, 16, 512, split_k=2), (_GEMV,)),
    (("mxfp4", {}), False, 20, LinearConfig("splitk", 16, 128, 128, split_k=2), (_WEIGHT_ONLY,)),
    (
        ("fp8-block", {}),
        True,
        1,
        LinearConfig("splitk", 16, 64, 128, split_k=2),
        (_ACT_QUANT, _FP8_BLOCK_GEMM),
    ),
)


def _misaligned_copy(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a contiguous tensor starting one element past a 16-byte boundary."""
    buffer = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    out = buffer[1:].view(x.shape)
    out.copy_(x)
    assert out.data_ptr() % 16 != 0
    return out


def _normal_then_direct(run, x, launchers: tuple[FastLaunch, ...]) -> torch.Tensor:
    """``run(x)`` by the normal launch (caches cleared), then twice directly: all equal."""
    for launcher in launchers:
        launcher.clear()
    normal = run(x)
    keys = [len(launcher.cached_keys()) for launcher in launchers]
    assert all(count >= 1 for count in keys), "the call did not go through its launchers"
    for _ in range(2):
        direct = run(x)
        assert torch.equal(direct, normal)
    assert [len(launcher.cached_keys()) for launcher in launchers] == keys  # no new launch key
    return normal


@pytest.mark.parametrize("case, w8a8, m, cfg, launchers", LAUNCH_SITES, ids=lambda v: str(v)[:40])
def test_direct_launches_match_normal_launch_and_reference(case, w8a8, m, cfg, launchers):
    p = quantized(N, K, case).to("cuda")
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    reference = reference_w8a8_linear if w8a8 else reference_linear

    def run(x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, p, bias, w8a8=w8a8, config=cfg)

    first = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    _normal_then_direct(run, first, launchers)
    for _ in range(2):  # fresh inputs through the cached launchers
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        direct = run(x)
        assert rel_err(direct, reference(x.double(), p, bias.double())) < 8e-3
        for launcher in launchers:
            launcher.clear()
        assert torch.equal(run(x), direct)  # the normal launch of the same key
    shifted = _misaligned_copy(torch.randn(m, K, device="cuda", dtype=torch.bfloat16))
    out = _normal_then_direct(run, shifted, launchers)
    assert rel_err(out, reference(shifted.double(), p, bias.double())) < 8e-3


@pytest.mark.parametrize("case", (("int4", {"group_size": 128}), ("fp8-block", {})), ids=str)
def test_direct_dequantize_launch_is_bit_exact(case):
    p = quantized(N, K, case).to("cuda")
    _DEQUANT.clear()
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        assert torch.equal(dequantize_triton(p, dtype), dequantize(p, dtype))
        assert torch.equal(dequantize_triton(p, dtype), dequantize(p, dtype))
    assert len(_DEQUANT.cached_keys()) == 2  # one normal launch per output dtype
