"""Hook points: named identity taps on activations, independent of any model library.

A hook function has the signature ``fn(tensor, hook) -> Tensor | None``. Returning ``None``
leaves the activation unchanged; returning a tensor replaces it (it must keep the shape and
dtype). Forward hooks see activations; backward hooks see the gradient of the activation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor

HookFn = Callable[[Tensor, "HookPoint"], "Tensor | None"]
# Set on a tensor that shows, for its hook point, an activation computed beside the model's
# own computation: its backward hooks may read the gradient but not replace it.
SIDE_COMPUTATION = "_qlens_side_computation"


def mark_side_computation(x: Tensor) -> Tensor:
    """Mark ``x`` (see ``SIDE_COMPUTATION``) and return it."""
    setattr(x, SIDE_COMPUTATION, True)
    return x


class HookHandle:
    """Removes one hook function from its HookPoint; removing twice is harmless."""

    def __init__(
        self, point: HookPoint, fn: HookFn, direction: str, is_permanent: bool = False
    ) -> None:
        self.point = point
        self.fn = fn
        self.direction = direction
        self.is_permanent = is_permanent

    def remove(self) -> None:
        hooks = self.point.fwd_hooks if self.direction == "fwd" else self.point.bwd_hooks
        if self.fn not in hooks:
            return
        hooks.remove(self.fn)
        key = (self.direction, id(self.fn))
        if self.is_permanent and self.point.permanent[key] > 0:
            self.point.permanent[key] -= 1
            if not self.point.permanent[key]:
                del self.point.permanent[key]

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
        # how many times each hook function (direction, id) was added as one that resetting
        # keeps unless asked not to
        self.permanent: Counter[tuple[str, int]] = Counter()
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

    def add_hook(
        self, fn: HookFn, dir: str = "fwd", is_permanent: bool = False, prepend: bool = False
    ) -> HookHandle:
        """Register ``fn(tensor, hook)`` for ``dir`` 'fwd' or 'bwd', after the hooks already
        there (``prepend=True``: before them); the handle's ``remove()`` unregisters it. A
        permanent hook stays through ``remove_hooks`` unless ``including_permanent``."""
        if not callable(fn):
            raise TypeError(f"hook for {self.name!r} must be callable, got {type(fn).__name__}")
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"hook direction must be 'fwd' or 'bwd', got {dir!r}")
        hooks = self.fwd_hooks if dir == "fwd" else self.bwd_hooks
        hooks.insert(0, fn) if prepend else hooks.append(fn)
        if is_permanent:
            self.permanent[dir, id(fn)] += 1
        return HookHandle(self, fn, dir, is_permanent)

    def remove_hooks(
        self, dir: str = "both", including_permanent: bool = False, clear_context: bool = True
    ) -> None:
        """Drop the hook functions of one direction ('fwd', 'bwd' or 'both'), the permanent
        ones too when ``including_permanent``; clear the context unless ``clear_context`` is
        False."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"hook direction must be 'fwd', 'bwd' or 'both', got {dir!r}")
        for direction, hooks in (("fwd", self.fwd_hooks), ("bwd", self.bwd_hooks)):
            if dir not in (direction, "both"):
                continue
            if including_permanent:
                for fn in hooks:
                    self.permanent.pop((direction, id(fn)), None)
                hooks.clear()
                continue
            left = Counter({key: n for key, n in self.permanent.items() if key[0] == direction})
            kept = []
            for fn in hooks:  # as many of each function as were added permanent
                if left[direction, id(fn)] > 0:
                    left[direction, id(fn)] -= 1
                    kept.append(fn)
            hooks[:] = kept
        if clear_context:
            self.ctx.clear()

    def forward(self, x: Tensor) -> Tensor:
        self.fired = True  # written, never read here: a compiled forward does not guard on it
        for fn in list(self.fwd_hooks):
            x = self._checked(fn(x, self), x, "forward")
        if self.bwd_hooks and x.requires_grad:
            side = getattr(x, SIDE_COMPUTATION, False)
            x.register_hook(self._observe_backward if side else self._run_backward)
        return x

    __call__ = forward

    def _run_backward(self, grad: Tensor) -> Tensor:
        for fn in list(self.bwd_hooks):
            grad = self._checked(fn(grad, self), grad, "backward")
        return grad

    def _observe_backward(self, grad: Tensor) -> Tensor:
        """Backward hooks on a side computation's copy (``mark_side_computation``): they see
        its gradient, but a gradient they return would reach no earlier layer, so it is
        refused."""
        seen = grad
        for fn in list(self.bwd_hooks):
            grad = self._checked(fn(grad, self), grad, "backward")
        if grad is not seen:
            raise RuntimeError(
                f"a backward hook on {self.name!r} returned a new gradient, but this activation "
                "is computed beside the model's own computation, so an edited gradient would "
                "reach no earlier layer. Read its gradient here; edit gradients at a name on "
                "the model's path (hook_resid_pre, hook_attn_out, hook_mlp_out...)."
            )
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
