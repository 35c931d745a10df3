"""Activations recorded during a compiled decode: bridge hooks that write each processed token's
activation into a buffer of the whole sequence's length, at that token's position.

Inside a CUDA graph a hook cannot keep the tensor it sees (the graph reuses that memory on its
next replay). Writing into a buffer that keeps its address, at a position the decode state
holds on the device, is a graph operation like the KV cache's update; the buffers are read once
the decode ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from qlens.hooks import HookPoint

# Attention maps are [batch head query_pos key_pos]; every other activation is [batch pos ...].
_QUERY_AXIS_TWO = ("hook_pattern", "hook_attn_scores")


def position_axis(name: str) -> int:
    """The axis of the query position in the activation a hook point shows."""
    return 2 if name.endswith(_QUERY_AXIS_TWO) else 1


class DecodeRecorder:
    """One buffer per hook name, ``max_length`` positions long, allocated when the prompt's
    forward first fires the hook; ``hooks`` write each activation at ``cursor`` (a one-element
    tensor: the position of the first token the forward processes)."""

    def __init__(self, names: Sequence[str], cursor: Tensor, max_length: int) -> None:
        self.names = tuple(names)
        self.cursor = cursor
        self.max_length = max_length
        self.buffers: dict[str, Tensor] = {}
        self.hooks: list[tuple[str, Callable[[Tensor, HookPoint], None]]] = [
            (name, self._writer(name)) for name in self.names
        ]

    def _writer(self, name: str) -> Callable[[Tensor, HookPoint], None]:
        axis = position_axis(name)

        def write(x: Tensor, hook: HookPoint) -> None:
            buffer = self.buffers.get(name)
            if buffer is None:  # the prompt's forward, which runs eagerly
                buffer = self.buffers[name] = self._allocate(name, x, axis)
            positions = self.cursor + torch.arange(x.shape[axis], device=x.device)
            buffer.index_copy_(axis, positions, x.detach().to(buffer.dtype))

        return write

    def _allocate(self, name: str, x: Tensor, axis: int) -> Tensor:
        if x.ndim <= axis:
            raise ValueError(
                f"cannot record {name} while decoding: its activation of shape "
                f"{list(x.shape)} has no position axis {axis}"
            )
        shape = list(x.shape)
        shape[axis] = self.max_length
        buffer = torch.zeros(shape, dtype=x.dtype, device=x.device)
        torch._dynamo.mark_static_address(buffer)
        return buffer

    def activations(self, length: int) -> dict[str, Tensor]:
        """Copies of the first ``length`` positions of every buffer (attention maps: of their
        queries and keys both)."""
        out = {}
        for name in self.names:
            buffer = self.buffers.get(name)
            if buffer is None:
                raise RuntimeError(f"{name} never fired while decoding, so nothing was recorded")
            axis = position_axis(name)
            kept = buffer.narrow(axis, 0, length)
            if axis == 2 and kept.ndim > 3:  # the key axis of an attention map
                kept = kept.narrow(3, 0, min(length, kept.shape[3]))
            out[name] = kept.clone()
        return out
