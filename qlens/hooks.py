"""Hook points: named identity taps on activations, independent of any model library.

A hook function has the signature ``fn(tensor, hook) -> Tensor | None``. Returning ``None``
leaves the activation unchanged; returning a tensor replaces it (it must keep the shape and
dtype). Forward hooks see activations; backward hooks see the gradient of the activation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

HookFn = Callable[[Tensor, "HookPoint"], "Tensor | None"]


class HookHandle:
    """Removes one hook function from its HookPoint; removing twice is harmless."""

    def __init__(self, point: HookPoint, fn: HookFn, direction: str) -> None:
        self.point = point
        self.fn = fn
        self.direction = direction

    def remove(self) -> None:
        hooks = self.point.fwd_hooks if self.direction == "fwd" else self.point.bwd_hooks
        if self.fn in hooks:
            hooks.remove(self.fn)

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HookPoint:
    """An identity point on an activation, known by its canonical name.

    Calling the point runs its forward hooks in registration order (each sees the previous
    one's result) and, when backward hooks exist, registers them on the returned tensor.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.fwd_hooks: list[HookFn] = []
        self.bwd_hooks: list[HookFn] = []
        self.ctx: dict[str, object] = {}
        self.fired = False  # whether it ran since the owner last reset it

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, fwd={len(self.fwd_hooks)}, bwd={len(self.bwd_hooks)})"

    def layer(self) -> int:
        """The block index in the name (``blocks.3.attn.hook_q`` -> 3), as TransformerLens."""
        parts = self.name.split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise ValueError(
                f"hook point {self.name!r} belongs to no block; layer() needs a "
                "'blocks.{i}.' name"
            )
        return int(parts[1])

    @property
    def is_active(self) -> bool:
        return bool(self.fwd_hooks or self.bwd_hooks)

    def add_hook(self, fn: HookFn, dir: str = "fwd") -> HookHandle:
        """Register ``fn(tensor, hook)`` for ``dir`` 'fwd' or 'bwd'; the handle's ``remove()``
        unregisters it."""
        if not callable(fn):
            raise TypeError(f"hook for {self.name!r} must be callable, got {type(fn).__name__}")
        if dir == "fwd":
            self.fwd_hooks.append(fn)
        elif dir == "bwd":
            self.bwd_hooks.append(fn)
        else:
            raise ValueError(f"hook direction must be 'fwd' or 'bwd', got {dir!r}")
        return HookHandle(self, fn, dir)

    def remove_hooks(self, dir: str = "both") -> None:
        """Drop all hook functions in one direction ('fwd', 'bwd' or 'both'); clear the context."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"hook direction must be 'fwd', 'bwd' or 'both', got {dir!r}")
        if dir in ("fwd", "both"):
            self.fwd_hooks.clear()
        if dir in ("bwd", "both"):
            self.bwd_hooks.clear()
        self.ctx.clear()

    def forward(self, x: Tensor) -> Tensor:
        self.fired = True  # written, never read here: a compiled forward does not guard on it
        for fn in list(self.fwd_hooks):
            x = self._checked(fn(x, self), x, "forward")
        if self.bwd_hooks and x.requires_grad:
            x.register_hook(self._run_backward)
        return x

    __call__ = forward

    def _run_backward(self, grad: Tensor) -> Tensor:
        for fn in list(self.bwd_hooks):
            grad = self._checked(fn(grad, self), grad, "backward")
        return grad

    def _checked(self, result: object, original: Tensor, phase: str) -> Tensor:
        if result is None:
            return original
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"{phase} hook on {self.name!r} returned {type(result).__name__}; "
                "return a Tensor to replace the activation or None to keep it"
            )
        if result.shape != original.shape or result.dtype != original.dtype:
            raise ValueError(
                f"{phase} hook on {self.name!r} returned a tensor of shape {tuple(result.shape)} "
                f"and dtype {result.dtype}, but the activation has shape {tuple(original.shape)} "
                f"and dtype {original.dtype}; return a tensor of the same shape and dtype"
            )
        if result.device != original.device:
            raise ValueError(
                f"{phase} hook on {self.name!r} returned a tensor on {result.device}, but the "
                f"activation is on {original.device}; return `new.to(activation.device)`"
            )
        return result
