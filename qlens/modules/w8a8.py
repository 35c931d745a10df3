"""Switch a model's block-FP8 linears between weight-only and W8A8 (FP8 activations) numerics."""

from __future__ import annotations

from typing import Any

from torch import nn

from qlens.kernels.plan import W8A8_FORMATS, w8a8_problem
from qlens.modules.linear import QuantLinear
from qlens.modules.reroute import rerouted_linear_payload, set_rerouted_w8a8


def set_w8a8(model_or_bridge: Any, enabled: bool = True) -> int:
    """Switch every block-FP8 linear of the model between W8A8 and weight-only numerics.

    With ``enabled=True`` each ``QuantLinear`` whose weight is block FP8, and each of
    transformers' ``FP8Linear`` modules a Bridge rerouted through qlens, quantizes its inputs
    per token and K block of the weight (128 in DeepSeek-style checkpoints) to FP8 before the
    matmul, as transformers' ``FP8Linear`` (and DeepSeek's reference) runs FP8 checkpoints on a
    GPU; ``False`` returns them to the weight-only matmul on the exact weight (what transformers
    computes on a CPU, where it dequantizes FP8 checkpoints). Per-tensor FP8 weights and other
    quantized layers are left as they are. Returns how many linears were set; raises when the
    model has none to set (a switch that changes nothing is an error).
    """
    model = model_or_bridge if isinstance(model_or_bridge, nn.Module) else None
    if model is None:
        model = getattr(model_or_bridge, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                "set_w8a8 expects an nn.Module or a qlens Bridge; got "
                f"{type(model_or_bridge).__name__}"
            )
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            weight = module.payload
            if w8a8_problem(weight.format, weight.shape) is None:
                module.w8a8 = enabled
                count += 1
            continue
        rerouted = rerouted_linear_payload(module)
        if rerouted is not None and w8a8_problem(rerouted.format, rerouted.shape) is None:
            set_rerouted_w8a8(module, enabled)
            count += 1
    if not count:
        raise ValueError(
            f"the model has no blocked {'/'.join(W8A8_FORMATS)} linear (a QuantLinear, or an "
            "FP8Linear a Bridge rerouted), so W8A8 applies to none of its layers; quantize it "
            "with qlens.quantize(model, 'fp8-block') or load a block-FP8 checkpoint with "
            "qlens.load first"
        )
    return count
