"""Packed 4-bit weights as int32 words, and experts stacked along them (plain torch, no Triton).

What the word-wise kernels read, described without importing them, so the dispatcher and the
experts' plans can decide on the CPU and without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qlens.kernels.weights import KernelWeight


def word_view(w: KernelWeight) -> Tensor | None:
    """The packed 4-bit data as int32 words ``[n, width / 4]``, or ``None`` when rows are not
    whole, 16-byte aligned words (then the byte-wise kernel serves the weight).
    """
    data = w.data
    if not w.packed or data.shape[1] % 4 or data.data_ptr() % 16:
        return None
    return data.view(torch.int32)


@dataclass(frozen=True)
class ExpertStrides:
    """Experts stacked as consecutive blocks of rows: one expert's data, scales and global
    scale lie ``data``, ``scales`` and ``global_scale`` elements apart (0: shared); ``data``
    counts the elements the kernels read (int32 words of packed 4-bit codes, or bytes)."""

    data: int
    scales: int
    global_scale: int


@dataclass(frozen=True)
class ExpertRows(ExpertStrides):
    """Row ``m`` of ``x`` multiplies expert ``ids[m]`` of experts stacked at these strides."""

    ids: Tensor
