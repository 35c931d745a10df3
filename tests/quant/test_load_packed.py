"""FP8-block and GPT-OSS MXFP4 checkpoints load packed through `qlens.load` on the CPU, where
transformers would dequantize them (checkpoints: see transformers_checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers_checkpoints import write_fp8_block_checkpoint, write_gpt_oss_mxfp4_checkpoint

import qlens
from qlens.kernels.runtime import interpreting
from qlens.modules import QuantExperts, QuantLinear

transformers = pytest.importorskip("transformers")
TOKENS = torch.tensor([[1, 5, 9, 2, 17, 3]])


def test_fp8_block_linears_stay_packed(tmp_path: Path) -> None:
    payloads = write_fp8_block_checkpoint(tmp_path)
    bridge = qlens.load(tmp_path, dtype=torch.float32)
    for name, payload in payloads.items():
        module = bridge.model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(module, QuantLinear), name
        assert torch.equal(module.payload.data.view(torch.uint8), payload.data.view(torch.uint8))
        assert torch.equal(module.payload.scales, payload.scales)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
    ).eval()
    for name in payloads:
        packed = bridge.model.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(qlens.dequantize(packed), reference.get_parameter(name)), name
    with torch.no_grad():
        ours, theirs = bridge(TOKENS), reference(TOKENS).logits
    # Same fp32 weights; the matmuls may sum in a different order.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    floats = qlens.load(tmp_path, dtype=torch.float32, dequantize=True)
    assert not any(isinstance(m, QuantLinear) for m in floats.model.modules())
    for name in payloads:
        assert torch.equal(floats.model.get_parameter(name), reference.get_parameter(name))


def test_gpt_oss_mxfp4_experts_stay_packed(tmp_path: Path) -> None:
    payloads = write_gpt_oss_mxfp4_checkpoint(tmp_path)
    bridge = qlens.load(tmp_path, dtype=torch.bfloat16)
    experts = bridge.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.bfloat16,
    ).eval()
    for key, payload in payloads.items():
        prefix = "gate_up" if "gate_up" in key else "down"
        ours = qlens.dequantize(experts.payload_for(prefix), torch.bfloat16)
        assert torch.equal(ours, qlens.dequantize(payload, torch.bfloat16)), key
        assert torch.equal(ours.transpose(1, 2), reference.get_parameter(key)), key
    with torch.no_grad():
        ours_logits, theirs = bridge(TOKENS).float(), reference(TOKENS).logits.float()
    # bf16 activations: each path rounds its own intermediate sums to bf16.
    torch.testing.assert_close(
        ours_logits, theirs, rtol=0.05, atol=0.05 * theirs.abs().max().item()
    )


def test_incomplete_fp8_checkpoint_is_refused(tmp_path: Path) -> None:
    write_fp8_block_checkpoint(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks tensors for model\.layers\.0\.mlp\.up_proj\.weight: .* no scales"
    ):
        qlens.load(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(),
    reason="needs a CUDA GPU with TRITON_INTERPRET=0",
)
def test_fp8_block_checkpoint_loads_packed_onto_the_gpu(tmp_path: Path) -> None:
    payloads = write_fp8_block_checkpoint(tmp_path)
    on_gpu = qlens.load(tmp_path, dtype=torch.bfloat16, device="cuda")
    on_cpu = qlens.load(tmp_path, dtype=torch.bfloat16)
    for name in payloads:
        module = on_gpu.model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(module, QuantLinear) and module.payload.data.device.type == "cuda"
        cpu_module = on_cpu.model.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(qlens.dequantize(module).cpu(), qlens.dequantize(cpu_module))
    tokens = torch.tensor([[1, 5, 9, 2, 17, 3]])
    with torch.no_grad():
        ours, theirs = on_gpu(tokens.cuda()).float().cpu(), on_cpu(tokens).float()
    # bf16 outputs: the GPU kernel and the CPU reference round their sums differently.
    torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05 * theirs.abs().max().item())
