"""Dynamo's tensor guards on payload buffers, taken over by a caller that compiles a loop.

Dynamo guards every tensor a compiled graph reads (``TENSOR_MATCH``: dtype, device, shape,
strides). Under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` it still checks the
guards that tell its cached graphs apart, and those include the tensor guards of every tensor
that is not an ``nn.Parameter``: payload buffers (two to five a quantized linear) are checked
on every call, parameters are not. On a 32-layer Llama that made a quantized decode step's
guard check 1.7-3.0 ms against bf16's 0.27 (``benchmarks/results/static_decode_guards_cpu.md``).

A caller that runs one compiled graph many times can drop those guards at compile time
(``without_payload_tensor_guards``) and check the same properties itself once in a while
(``payload_signature``), recompiling when they changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from qlens.modules.payload_buffers import PayloadModule

__all__ = ["payload_signature", "payload_tensors", "without_payload_tensor_guards"]

Signature = tuple[tuple[torch.device, torch.dtype, torch.Size, tuple[int, ...]], ...]


def payload_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every payload buffer of the quantized modules in ``model``, in module order."""
    return [
        tensor
        for module in model.modules()
        if isinstance(module, PayloadModule)
        for prefix in module.payload_specs()
        for tensor in module.payload_tensors(prefix)
    ]


def payload_signature(model: nn.Module) -> Signature:
    """What dynamo's tensor guards check of each payload buffer: device, dtype, shape and
    strides (a graph traced on other values must not run on these)."""
    return tuple((t.device, t.dtype, t.shape, t.stride()) for t in payload_tensors(model))


def without_payload_tensor_guards(
    model: nn.Module,
) -> Callable[[Sequence[Any]], list[bool]]:
    """A ``torch.compile`` ``guard_filter_fn`` keeping every guard but the tensor guards of
    ``model``'s payload buffers (found when the graph is compiled). Whoever compiles with it
    must check ``payload_signature`` before running the graph again."""

    def keep(entries: Sequence[Any]) -> list[bool]:
        ids = {id(t) for t in payload_tensors(model)}
        return [not (e.guard_type == "TENSOR_MATCH" and id(e.value) in ids) for e in entries]

    return keep
