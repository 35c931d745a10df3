"""Defining ``qlens::`` ops the lean way: cheap for the host to call.

A compiled graph outside CUDA graphs calls each quantized linear's op once per forward, so
what the dispatcher runs around an op's body is host time on every token. An op defined here
(:func:`qlens_op`) is a ``torch.library.Library`` registration: the body is the op's
CompositeExplicitAutograd kernel, and one Python kernel at the Autograd key redispatches
straight to it unless a gradient must be recorded. ``torch.library.custom_op`` puts its own
autograd kernel, a dynamo-disabled wrapper and an output aliasing check around every call;
``benchmarks/results/host_time_cpu.md`` times ``qlens::linear`` both ways.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

__all__ = ["QlensOp", "qlens_op"]

# Holds every registration of the qlens:: ops for as long as qlens is imported.
_LIBRARY = torch.library.Library("qlens", "FRAGMENT")

Backward = Callable[..., Any]
SetupContext = Callable[[Any, tuple[Any, ...], Any], None]


class QlensOp:
    """One ``qlens::`` op defined from a Python function. ``default`` is its ``OpOverload``
    (what graphs record, what ``torch.library.opcheck`` takes); ``register_fake`` and
    ``register_autograd`` work as on the ops of ``torch.library.custom_op``."""

    def __init__(self, name: str, body: Callable[..., Any]) -> None:
        _require_positional(name, body)
        self.name = f"qlens::{name}"
        _LIBRARY.define(
            name + torch.library.infer_schema(body, mutates_args=()),
            tags=(torch.Tag.pt2_compliant_tag,),
        )
        _LIBRARY.impl(name, body, "CompositeExplicitAutograd")
        self.default: OpOverload = getattr(torch.ops.qlens, name).default
        self._recorded: Callable[..., Any] = self._no_gradient
        _LIBRARY.impl(name, _autograd_kernel(self), "Autograd", with_keyset=True)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fake`` (shapes and dtypes only) for tracing; usable as a decorator."""
        torch.library.register_fake(self.name, fake, lib=_LIBRARY)
        return fake

    def register_autograd(self, backward: Backward, *, setup_context: SetupContext) -> None:
        """Record calls with an input that requires grad (grad mode on) so that ``backward``
        runs, with ``register_autograd``'s contract: ``setup_context(ctx, inputs, output)``
        saves what ``backward(ctx, *grads)`` needs, which returns one gradient (or None) per
        input. ``Tensor[]`` inputs get None whatever it returns for them."""
        self._recorded = _recording_function(self, backward, setup_context).apply

    def _no_gradient(self, *args: Any) -> Any:
        raise RuntimeError(
            f"{self.name} has no gradient, but it was called with an input that requires grad "
            "while grad mode is on: call it under torch.no_grad() or with detached inputs"
        )


def qlens_op(name: str) -> Callable[[Callable[..., Any]], QlensOp]:
    """Decorator: the op ``qlens::<name>`` whose body is the decorated function (its schema
    read from its annotations, as ``torch.library.custom_op`` reads it; nothing mutated)."""
    return lambda body: QlensOp(name, body)


def _autograd_kernel(op: QlensOp) -> Callable[..., Any]:
    """The op's Autograd-key kernel: the recorded call when grad mode is on and an input
    (or a tensor in a ``Tensor[]`` input) requires grad, else straight to the body."""
    redispatch = op.default._handle.redispatch_boxed
    after_autograd = torch._C._after_autograd_keyset
    is_grad_enabled = torch._C.is_grad_enabled
    any_requires_grad = torch._C._any_requires_grad

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        if is_grad_enabled() and any_requires_grad(*args):
            return op._recorded(*args)
        return redispatch(keyset & after_autograd, *args)

    return kernel


def _recording_function(
    op: QlensOp, backward: Backward, setup_context: SetupContext
) -> type[torch.autograd.Function]:
    """The ``torch.autograd.Function`` that runs ``op`` below autograd and ``backward`` after."""
    overload = op.default
    lists = tuple(
        isinstance(arg.type, torch.ListType) for arg in overload._schema.arguments
    )  # Tensor[] and Tensor?[] inputs: no gradient

    def forward(*args: Any) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args)

    def backward_inputs(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        got = backward(ctx, *grads)
        return tuple(None if is_list else g for g, is_list in zip(got, lists, strict=True))

    return type(
        f"{overload._opname}_recorded",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward_inputs),
        },
    )


def _require_positional(name: str, body: Callable[..., Any]) -> None:
    """The Autograd kernel passes the inputs on as they come: positional, none defaulted."""
    for param in inspect.signature(body).parameters.values():
        if param.kind is not param.POSITIONAL_OR_KEYWORD or param.default is not param.empty:
            raise TypeError(
                f"qlens::{name}: every argument must be positional without a default; "
                f"{param.name!r} is not"
            )
