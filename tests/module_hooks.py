"""Plain PyTorch forward hooks on an HF model's own modules: the oracle the bridge's hooks are
compared with (what HF computes, and what HF computes when a module's output is replaced)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


@contextmanager
def replacing(model: nn.Module, edits: dict[str, Callable[[Any], Any]]) -> Iterator[None]:
    """Inside the block, the module at each path returns ``edit(output)`` (``None``: unchanged)."""
    handles = [
        model.get_submodule(path).register_forward_hook(lambda _m, _i, out, edit=edit: edit(out))
        for path, edit in edits.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def recording(model: nn.Module, paths: list[str]) -> Iterator[dict[str, Any]]:
    """The outputs of the modules at ``paths`` during the forwards inside the block."""
    outputs: dict[str, Any] = {}
    edits = {path: lambda out, path=path: outputs.__setitem__(path, out) for path in paths}
    with replacing(model, edits):
        yield outputs
