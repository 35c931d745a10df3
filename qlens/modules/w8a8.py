"""Switch a model's block-FP8 linears between weight-only and W8A8 (FP8 activations) numerics."""

from __future__ import annotations

from typing import Any

from torch import nn

from qlens.kernels.plan import W8A8_FORMATS
from qlens.modules.linear import QuantLinear


def set_w8a8(model_or_bridge: Any, enabled: bool = True) -> int:
    """Set ``w8a8`` on every ``QuantLinear`` of the model whose weight is block FP8.

    With ``enabled=True`` those linears quantize their inputs per token and block of 128 along
    K to FP8 before the matmul, as transformers' ``FP8Linear`` (and DeepSeek's reference) runs
    FP8 checkpoints; ``False`` returns them to the weight-only matmul on the exact weight.
    Other quantized layers are left as they are. Returns how many linears were set; raises
    when the model has none to set (a switch that changes nothing is an error).
    """
    model = model_or_bridge if isinstance(model_or_bridge, nn.Module) else None
    if model is None:
        model = getattr(model_or_bridge, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                "set_w8a8 expects an nn.Module or a qlens Bridge; got "
                f"{type(model_or_bridge).__name__}"
            )
    linears = [
        module
        for module in model.modules()
        if isinstance(module, QuantLinear) and module.payload.format.name in W8A8_FORMATS
    ]
    if not linears:
        raise ValueError(
            f"the model has no QuantLinear with {'/'.join(W8A8_FORMATS)} weights, so W8A8 "
            "applies to none of its layers; quantize it with qlens.quantize(model, "
            "'fp8-block'), load a block-FP8 checkpoint with qlens.load, or swap transformers' "
            "FP8Linear modules for QuantLinear with qlens.modules.convert.to_quant_linears(model)"
        )
    for module in linears:
        module.w8a8 = enabled
    return len(linears)
