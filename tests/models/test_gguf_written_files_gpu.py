"""GGUF files written by gguf-py (dense Llamas, Qwen3-MoE and Mixtral), loaded onto a CUDA GPU: the same
weights and logits as on the CPU (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    K_QUANT_F16_OFFSETS,
    QUANTIZABLE,
    make_gguf_llama,
    make_gguf_mixtral,
    write_gguf_llama,
)
from gguf_moe_files import N_LAYERS, make_gguf_moe, moe_type_of, write_gguf_moe  # noqa: E402
from model_fixtures import make_tiny_tokenizer  # noqa: E402

import qlens  # noqa: E402
from qlens.kernels.runtime import interpreting  # noqa: E402
from qlens.modules import QuantExperts, QuantLinear  # noqa: E402

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


MOE_CASES = [("qwen3moe", k) for k in ("Q8_0", "Q4_0", "mixed")]
MOE_CASES += [("mixtral", k) for k in ("Q8_0", "Q4_K", "mixed")]
MOE_CASES += [("mixtral-per-expert", k) for k in ("Q4_K", "mixed")]  # one tensor per expert


@pytest.mark.parametrize(("arch", "kind"), MOE_CASES, ids=[f"{a}-{k}" for a, k in MOE_CASES])
def test_moe_gguf_file_on_cuda_matches_the_cpu_load(tmp_path: Path, arch: str, kind: str):
    path = tmp_path / f"tiny-{arch}-{kind}.gguf"
    if arch.startswith("mixtral"):  # as llama.cpp writes Mixtral: architecture llama, experts
        per_expert = arch == "mixtral-per-expert"
        write_gguf_llama(make_gguf_mixtral(), path, moe_type_of(kind), per_expert=per_expert)
    else:
        write_gguf_moe(make_gguf_moe(arch), path, arch, moe_type_of(kind))
    cpu = qlens.load(path, tokenizer=make_tiny_tokenizer())
    gpu = qlens.load(path, device="cuda", tokenizer=make_tiny_tokenizer())
    experts = [(n, m) for n, m in gpu.model.named_modules() if isinstance(m, QuantExperts)]
    assert len(experts) == N_LAYERS
    for name, module in experts:
        expected = qlens.dequantize(cpu.model.get_submodule(name))
        for leaf, values in qlens.dequantize(module).items():
            assert values.device.type == "cuda"
            assert torch.equal(values.cpu(), expected[leaf]), f"{name}.{leaf}"
    # 7 tokens route 14 (token, expert) rows, 48 route 96: both run each hit expert through
    # qlens.kernels.linear (the GGUF dequantize kernel then cuBLAS, the reference for K-quants).
    for length in (7, 48):
        tokens = torch.arange(length).reshape(1, -1) * 7 % 64
        with torch.no_grad():
            ours, theirs = gpu(tokens.cuda()).cpu(), cpu(tokens)
        # Same float32 weights and routers; cuBLAS (TF32 off by default) sums the <= 768-term
        # dots in another order than the CPU, a few ulps each, grown through two layers.
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())
