"""Switch a model's block-FP8 linears between weight-only and W8A8 (FP8 activations) numerics."""

from __future__ import annotations

from typing import Any

from torch import nn

from qlens.kernels.plan import W8A8_FORMATS, w8a8_problem
from qlens.modules.experts import QuantExperts
from qlens.modules.linear import QuantLinear
from qlens.modules.reroute import rerouted_payloads, set_rerouted_w8a8
from qlens.quant.payload import QuantPayload


def set_w8a8(model_or_bridge: Any, enabled: bool = True) -> int:
    """Switch every block-FP8 linear of the model between W8A8 and weight-only numerics.

    With ``enabled=True`` each ``QuantLinear`` and ``QuantExperts`` whose weights are block FP8,
    and each of transformers' ``FP8Linear``/``FP8Experts`` a Bridge rerouted through qlens, quantizes
    its inputs per token and K block of the weight (128 in DeepSeek-style checkpoints) to FP8
    before the matmul, as transformers' ``FP8Linear``/``FP8Experts`` (and DeepSeek's reference)
    run FP8 checkpoints on a GPU; ``False`` returns them to the weight-only matmul on the exact
    weight (what transformers computes on a CPU, where it dequantizes FP8 checkpoints).
    Per-tensor FP8 weights and other quantized layers are left as they are. Returns how many
    modules were set; raises when the model has none to set (a switch that changes nothing is
    an error).
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
            payloads = [module.payload]
        elif isinstance(module, QuantExperts):
            payloads = [module.gate_up_payload, module.down_payload]
        else:
            rerouted = rerouted_payloads(module)
            if rerouted is None:
                continue
            payloads = [rerouted] if isinstance(rerouted, QuantPayload) else list(rerouted.values())
        if not all(w8a8_problem(p.format, p.shape) is None for p in payloads):
            continue
        if isinstance(module, QuantLinear | QuantExperts):
            module.w8a8 = enabled
        else:
            set_rerouted_w8a8(module, enabled)
        count += 1
    if not count:
        raise ValueError(
            f"the model has no blocked {'/'.join(W8A8_FORMATS)} linear or experts module (qlens' "
            "or transformers' FP8 modules a Bridge rerouted), so W8A8 applies to none of its "
            "layers; quantize it with qlens.quantize(model, 'fp8-block') or load a block-FP8 "
            "checkpoint with qlens.load first"
        )
    return count
