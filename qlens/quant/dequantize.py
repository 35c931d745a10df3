"""Explicit dequantization: a payload, a qlens QuantLinear or an HF quantized module -> float."""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor

from qlens.quant.codecs.registry import dequantizer_for
from qlens.quant.payload import QuantPayload


@overload
def dequantize(x: QuantPayload, dtype: torch.dtype = ...) -> Tensor: ...
@overload
def dequantize(x: Any, dtype: torch.dtype = ...) -> Tensor | dict[str, Tensor]: ...


def dequantize(x: Any, dtype: torch.dtype = torch.float32) -> Tensor | dict[str, Tensor]:
    """The float weight held by ``x``: ``[out, in]`` or ``[experts, out, in]``, in ``dtype``.

    ``x`` may be a :class:`QuantPayload`, a dict of payloads (gives a dict of tensors), an object
    with a ``payload`` attribute (a qlens QuantLinear), or an HF quantized module, which is read
    into payloads first by ``qlens.quant.adopt.adopt_module``. Nothing is dequantized implicitly.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dequantize dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(x, QuantPayload):
        return dequantizer_for(x.format.name)(x, dtype)
    if isinstance(x, dict) and x and all(isinstance(p, QuantPayload) for p in x.values()):
        return {name: dequantizer_for(p.format.name)(p, dtype) for name, p in x.items()}
    payload = getattr(x, "payload", None)
    if payload is not None and not isinstance(x, dict):
        return dequantize(payload, dtype)
    if isinstance(x, torch.nn.Module):
        from qlens.quant.adopt import adopt_module  # lazily: the integrations import HF code

        return dequantize(adopt_module(x), dtype)
    raise TypeError(
        f"qlens cannot dequantize a {type(x).__module__}.{type(x).__qualname__}: expected a "
        "QuantPayload (or a dict of them), a qlens QuantLinear or a quantized torch.nn.Module"
    )
