"""Weight storage for processing: write processed weights back, and scan every weight.

Reads go through :mod:`qlens.weights.access`; this module only replaces tensors and lists the
weights (parameters, 3-D experts, quantized modules) the guard refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qlens.quant.adopt.compressed_tensors import is_quantization_metadata
from qlens.quant.guards import unreadable_weight_reason
from qlens.weights.access import is_conv1d, is_hf_quantized, is_payload_module, stored_codes


def write_weight(module: nn.Module, value: Tensor) -> None:
    """Overwrite a float module's weight with ``value`` given as :func:`read_weight` returns it
    (``[out, in]`` for linear layers, Conv1D transposed back)."""
    write_tensor(module, "weight", value.T if is_conv1d(module) else value)


def write_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    """Set ``module.<name>`` to ``value`` in place (creating a frozen parameter if absent)."""
    current = getattr(module, name, None)
    if isinstance(current, Tensor) and current.shape == value.shape:
        if unreadable_weight_reason(current) is not None:
            raise NotImplementedError(
                f"qlens cannot write {type(module).__name__}.{name}: "
                f"{unreadable_weight_reason(current)}"
            )
        with torch.no_grad():
            current.copy_(value)
        return
    dtype = current.dtype if isinstance(current, Tensor) else value.dtype
    setattr(module, name, nn.Parameter(value.detach().to(dtype).clone(), requires_grad=False))


def replace_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    """Give ``module`` a new frozen parameter ``name`` (unsharing a tied weight)."""
    setattr(module, name, nn.Parameter(value.detach(), requires_grad=False))


@dataclass(frozen=True)
class UnreadableWeight:
    """A weight the guard refuses: where it is and why."""

    name: str
    reason: str
    module: nn.Module
    value: Any  # the refused tensor or object (a quantized module's stored codes)
    is_module: bool  # the whole module is quantized (vs one of its parameters)


def unreadable_weights(model: nn.Module) -> list[UnreadableWeight]:
    """Every weight of ``model`` that cannot be read as a float tensor: parameters (including 3-D
    experts and tensor subclasses), non-tensor weight attributes, and quantized modules (qlens
    payload modules, HF quantized modules)."""
    found: list[UnreadableWeight] = []
    for prefix, module in model.named_modules():
        where = f"{prefix}." if prefix else ""
        if is_payload_module(module) or is_hf_quantized(module):
            stored = stored_codes(module)
            reason = unreadable_weight_reason(stored) or "it is a quantized module"
            found.append(UnreadableWeight(prefix, reason, module, stored, True))
            continue
        for name, value in list(module._parameters.items()) + [
            ("weight", module.__dict__.get("weight"))
        ]:
            if value is None or is_quantization_metadata(module, name):
                continue
            why = unreadable_weight_reason(value)
            if why is not None:
                found.append(UnreadableWeight(where + name, why, module, value, False))
    return _without_children_of_quantized(found)


def _without_children_of_quantized(found: list[UnreadableWeight]) -> list[UnreadableWeight]:
    modules = [f.name for f in found if f.is_module]
    return [f for f in found if not any(f.name.startswith(m + ".") for m in modules if f.name != m)]


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's readable float parameters (float32 when it has none)."""
    for _, tensor in model.named_parameters():
        if unreadable_weight_reason(tensor) is None:
            return tensor.dtype
    return torch.float32
