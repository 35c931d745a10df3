"""Replace library-quantized linear modules by qlens ``QuantLinear`` modules holding the same
payload, so that a model quantized by a library qlens adopts can be saved by
``qlens.save_quantized`` and computes through qlens' own forward."""

from __future__ import annotations

from torch import Tensor, nn

from qlens.quant.adopt.core import adopt_module, is_quantized_module
from qlens.quant.payload import QuantPayload


def to_quant_linears(model: nn.Module) -> list[str]:
    """Swap every adoptable library-quantized linear of ``model`` for a ``QuantLinear`` (in place;
    the payload shares the library module's tensors); return the paths swapped.

    Modules holding several weights (fused experts) are left as they are.
    """
    from qlens.modules import QuantLinear
    from qlens.modules.payload_buffers import PayloadModule

    swapped = []
    for name, module in list(model.named_modules()):
        if not name or isinstance(module, PayloadModule) or not is_quantized_module(module):
            continue
        payload = adopt_module(module)
        if not isinstance(payload, QuantPayload) or len(payload.shape) != 2:
            continue
        bias = getattr(module, "bias", None)
        linear = QuantLinear(payload, bias.detach() if isinstance(bias, Tensor) else None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear.train(module.training))
        swapped.append(name)
    return swapped
