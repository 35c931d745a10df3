"""Adopting GPT-OSS MXFP4 experts against transformers' ``_convert_moe_packed_tensors``."""

import torch
from torch import nn
from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.registry import dequantizer_for

E, HIDDEN, INTER = 2, 64, 32


def _checkpoint_tensors(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, out_features, in_features // 32, 16), generator=gen)
    scales = torch.randint(118, 130, (E, out_features, in_features // 32), generator=gen)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def _tensors():
    return {
        "gate_up_proj": _checkpoint_tensors(2 * INTER, HIDDEN, 0),
        "down_proj": _checkpoint_tensors(HIDDEN, INTER, 1),
    }


def _check(payloads, tensors):
    assert set(payloads) == set(tensors)
    assert payloads["gate_up_proj"].layout["gate_up"] == "interleaved"
    for name, (blocks, scales) in tensors.items():
        # transformers returns the [E, in, out] orientation of HF's bf16 GptOssExperts.
        expected = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        got = dequantizer_for("mxfp4")(payloads[name], torch.float32)
        assert torch.equal(got.transpose(-1, -2), expected.reshape(E, -1, blocks.shape[1]))


def test_module_with_blocks_and_scales_buffers():
    tensors = _tensors()
    module = nn.Module()
    for name, (blocks, scales) in tensors.items():
        module.register_buffer(f"{name}_blocks", blocks)
        module.register_buffer(f"{name}_scales", scales)
    assert is_quantized_module(module)
    _check(adopt_module(module), tensors)


class StridedLayout:
    """Stand-in for triton_kernels' StridedLayout: the data is stored as is."""

    def unswizzle_data(self, data):
        return data


class Storage:
    def __init__(self, data):
        self.data, self.layout = data, StridedLayout()


class TritonKernelsTensor:
    """Stand-in for triton_kernels.tensor.Tensor: torch storage, overwritten logical shape."""

    def __init__(self, data, shape):
        self.storage, self.shape = Storage(data), shape


class PrecisionConfig:
    def __init__(self, weight_scale):
        self.weight_scale = weight_scale


def test_gpu_module_with_triton_kernels_wrappers():
    tensors = _tensors()
    module = nn.Module()
    for name, (blocks, scales) in tensors.items():
        out_features = blocks.shape[1]
        # The GPU module stores the transposed [E, in/2, out] bytes and [E, in/32, out] scales.
        data = blocks.reshape(E, out_features, -1).transpose(-1, -2).contiguous()
        setattr(module, name, TritonKernelsTensor(data, (E, -1, out_features)))
        scale_data = scales.transpose(-1, -2).contiguous()
        setattr(
            module,
            f"{name}_precision_config",
            PrecisionConfig(TritonKernelsTensor(scale_data, None)),
        )
    assert is_quantized_module(module)
    _check(adopt_module(module), tensors)


def test_dequantized_bf16_experts_are_not_quantized():
    module = nn.Module()
    module.gate_up_proj = nn.Parameter(torch.zeros(E, HIDDEN, 2 * INTER, dtype=torch.bfloat16))
    module.down_proj = nn.Parameter(torch.zeros(E, INTER, HIDDEN, dtype=torch.bfloat16))
    assert not is_quantized_module(module)
