"""The oracle for quantized models: the float model with each weight replaced by its dequantization.

The reference runs the unmodified transformers modules (nn.Linear, Conv1D, fused experts) on
``qlens.dequantize(payload)``, so it checks qlens' module swapping, orientation (Conv1D and
GPT-OSS weights are transposed), gate layouts, biases and routing independently of QuantLinear
and QuantExperts.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from qlens.modules import QuantExperts, QuantLinear
from qlens.quant.dequantize import dequantize


def dequantized_reference(float_model: nn.Module, quantized: nn.Module) -> nn.Module:
    """A copy of ``float_model`` holding the weights ``quantized`` actually computes with."""
    from transformers.pytorch_utils import Conv1D

    reference = copy.deepcopy(float_model)
    swapped = 0
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantLinear):
                target = reference.get_submodule(name)
                weight = dequantize(module.payload, torch.float32)
                target.weight.copy_(weight.T if isinstance(target, Conv1D) else weight)
                swapped += 1
            elif isinstance(module, QuantExperts):
                target = reference.get_submodule(name)
                gate_up = dequantize(module.gate_up_payload, torch.float32)
                down = dequantize(module.down_payload, torch.float32)
                if getattr(target, "is_transposed", False):
                    gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
                target.gate_up_proj.copy_(gate_up)
                target.down_proj.copy_(down)
                swapped += 1
    assert swapped, "the quantized model holds no QuantLinear/QuantExperts"
    return reference
