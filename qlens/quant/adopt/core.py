"""Dispatch: find the adopter that understands a module and read it into payloads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qlens.quant.payload import QuantPayload

Adopted = QuantPayload | dict[str, QuantPayload]


@dataclass(frozen=True)
class Adopter:
    """Reads one family of library-quantized modules into payloads, without modifying them."""

    name: str  # what it adopts, as listed in error messages
    matches: Callable[[nn.Module], bool]
    adopt: Callable[[nn.Module], Adopted]


_ADOPTERS: list[Adopter] = []


def register_adopter(name: str, matches: Callable[[nn.Module], bool]):
    """Decorator registering ``adopt(module)`` for modules where ``matches(module)`` is true."""

    def decorate(fn: Callable[[nn.Module], Adopted]) -> Callable[[nn.Module], Adopted]:
        _ADOPTERS.append(Adopter(name, matches, fn))
        return fn

    return decorate


def _adopters() -> list[Adopter]:
    # Importing the family modules registers their adopters.
    from qlens.quant.adopt import families  # noqa: F401

    return _ADOPTERS


def supported_modules() -> list[str]:
    """Names of the quantized module kinds :func:`adopt_module` reads."""
    return [a.name for a in _adopters()]


def _find(module: nn.Module) -> Adopter | None:
    for adopter in _adopters():
        if adopter.matches(module):
            return adopter
    return None


def is_quantized_module(module: nn.Module) -> bool:
    """Whether ``module`` holds a library-quantized weight qlens recognises.

    :func:`adopt_module` reads it, or raises saying why it cannot (e.g. quanto's CUDA AWQ
    layout).
    """
    return _find(module) is not None


def adopt_module(module: nn.Module) -> Adopted:
    """Read a library-quantized module into a payload (experts: a dict of payloads by name).

    The module is not modified; payload tensors may share storage with the module's tensors.
    """
    adopter = _find(module)
    if adopter is not None:
        return adopter.adopt(module)
    cls = f"{type(module).__module__}.{type(module).__qualname__}"
    weight: Any = getattr(module, "weight", None)
    # Tensor subclasses (torchao, quanto) report a float dtype while holding packed data.
    if type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    ):
        raise ValueError(
            f"{cls} holds a plain {weight.dtype} weight {list(weight.shape)}: it is not quantized, "
            "so there is nothing to adopt; read module.weight directly"
        )
    raise ValueError(
        f"qlens cannot adopt a quantized {cls}: unknown layout. Supported: "
        + "; ".join(supported_modules())
    )
