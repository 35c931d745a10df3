"""On a CUDA device: quantized models run qlens' Triton kernels and agree with the CPU reference."""

from __future__ import annotations

import pytest
import torch
from kernel_route import count_kernel_route
from tiny_models import input_ids, make_model

from qlens.modules.model_quantize import SCHEMES, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "gpt_oss", "qwen2_moe"])
def test_gpu_forward_uses_the_kernels_and_matches_the_cpu_reference(
    family: str, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantized = quantize(make_model(family), scheme)
    ids = input_ids()
    with torch.no_grad():
        expected = quantized(ids).logits  # CPU: torch reference (patched out below)
    calls = count_kernel_route(monkeypatch)
    quantized.to("cuda")
    with torch.no_grad():
        got = quantized(ids.cuda()).logits.cpu()
    assert calls, "the CUDA forward did not use qlens' kernels"
    # Same weights, fp32 accumulation: only the kernels' summation order differs (H200: <= 5e-7).
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    quantized.to(torch.bfloat16)
    with torch.no_grad():
        low = quantized(ids.cuda()).logits.float().cpu()
    scale = expected.abs().max().item()
    # bf16 activations and bias (H200: <= 1% of the logit scale)
    assert (low - expected).abs().max().item() < 0.05 * scale


def test_dequantize_only_formats_take_the_triton_dequantize_then_cublas() -> None:
    """GGUF Q4_1 has a dequantize kernel but no fused linear: on the GPU it is decoded by that
    kernel (bit-exact with the codec) and multiplied by cuBLAS, never the torch reference."""
    from qlens.kernels import linear
    from qlens.kernels.reference import reference_linear
    from qlens.quant.adopt.higgs_gguf import gguf_payload
    from qlens.quant.codecs.gguf import Q4_1

    blocks = torch.randint(0, 256, (96, 256 // 32 * Q4_1.type_size), dtype=torch.uint8)
    halfs = (torch.randn(96 * 256 // 32, 2) * 0.01).to(torch.float16)
    blocks.view(-1, Q4_1.type_size)[:, :4] = halfs.view(torch.uint8)
    payload = gguf_payload(blocks, Q4_1.type_id)
    x = torch.randn(5, 256)
    expected = reference_linear(x.double(), payload)
    got = linear(x.cuda(), payload.to("cuda")).cpu()
    # float32 weights bit-exact with the codec; cuBLAS fp32 (TF32 off by default) sums in another order.
    assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-6
