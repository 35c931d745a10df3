"""Slice: TransformerLens' ``pos_slice`` / ``neuron_slice`` / ``batch_slice`` semantics.

``None`` keeps the axis; an int indexes it (dropping the axis); a tuple is ``slice(*t)``
(``(k,)`` is ``:k``, ``(1, 5)`` is ``1:5``, ``(1, 5, 2)`` is ``1:5:2``); a ``slice`` is used as
is; a list, 1-D tensor or array of indices takes those positions. TransformerLens' own
``transformer_lens.utils.Slice`` objects are accepted too.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

SliceInput = Any  # None | int | tuple | slice | list[int] | Tensor | ndarray | Slice


class Slice:
    """One of TransformerLens' slice inputs, ready to apply along any axis."""

    def __init__(self, input_slice: SliceInput = None) -> None:
        inner = getattr(input_slice, "slice", None)
        if inner is not None and hasattr(input_slice, "mode"):  # a Slice (ours or TL's)
            input_slice = inner
        self.index: int | slice | Tensor
        if isinstance(input_slice, Tensor) and input_slice.ndim == 0:
            input_slice = int(input_slice)
        if input_slice is None:
            self.index, self.mode = slice(None), "identity"
        elif isinstance(input_slice, bool):
            raise TypeError("a slice cannot be a bool; pass an int, a tuple, a list or None")
        elif isinstance(input_slice, numbers.Integral):  # int, numpy integers
            self.index, self.mode = int(input_slice), "int"
        elif isinstance(input_slice, tuple):
            self.index, self.mode = slice(*input_slice), "slice"
        elif isinstance(input_slice, slice):
            self.index, self.mode = input_slice, "slice"
        elif isinstance(input_slice, (list, Tensor)) or type(input_slice).__name__ == "ndarray":
            indices = torch.as_tensor(input_slice)
            if indices.ndim != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
                raise ValueError(
                    f"a slice given as indices must be a 1-D list of ints, got {input_slice!r}"
                )
            self.index, self.mode = indices.long(), "array"
        else:
            raise TypeError(
                f"invalid slice {input_slice!r}: use None, an int, a (start, stop[, step]) tuple, "
                "a slice, or a list/tensor of indices"
            )

    @property
    def slice(self) -> int | slice | Tensor:
        """The index this slice applies (``transformer_lens.utils.Slice.slice``'s role)."""
        return self.index

    def apply(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """``tensor`` sliced along ``dim`` (an int slice removes the axis)."""
        index: Any = self.index
        if isinstance(index, Tensor):
            index = index.to(tensor.device)
        return tensor[(slice(None),) * (dim % tensor.ndim) + (index,)]

    def __repr__(self) -> str:
        return f"Slice({self.index!r}, mode={self.mode!r})"
