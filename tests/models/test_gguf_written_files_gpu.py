"""GGUF files written by gguf-py, loaded onto a CUDA GPU: the same weights and logits as on the CPU
(skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from gguf_files import K_QUANT_F16_OFFSETS, QUANTIZABLE, make_gguf_llama, write_gguf_llama  # noqa: E402
from model_fixtures import make_tiny_tokenizer  # noqa: E402

import qlens  # noqa: E402
from qlens.kernels.runtime import interpreting  # noqa: E402
from qlens.modules import QuantLinear  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]


@pytest.mark.parametrize("kind", [*QUANTIZABLE, *K_QUANT_F16_OFFSETS])
def test_gguf_file_on_cuda_matches_the_cpu_load(tmp_path: Path, kind: str):
    path = write_gguf_llama(make_gguf_llama(), tmp_path / f"tiny-{kind}.gguf", lambda _: kind)
    cpu = qlens.load(path, tokenizer=make_tiny_tokenizer())
    gpu = qlens.load(path, device="cuda", tokenizer=make_tiny_tokenizer())
    for name, module in gpu.model.named_modules():
        if isinstance(module, QuantLinear):
            expected = qlens.dequantize(cpu.model.get_submodule(name))
            assert torch.equal(qlens.dequantize(module).cpu(), expected), name
    tokens = torch.tensor([[3, 17, 42, 8, 63, 5, 29]])
    with torch.no_grad():
        ours, theirs = gpu(tokens.cuda()).cpu(), cpu(tokens)
    # Same float32 weights; cuBLAS (TF32 off by default) sums the <= 512-term dots in another
    # order than the CPU, a few ulps each, grown through two layers.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())
