"""Shared launch plumbing: the tensors and compile-time constants a weight passes to a kernel."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from qlens.kernels.weights import KernelWeight


def kernel_args(w: KernelWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scales, zeros, global_scale) pointers; absent tensors are replaced by the scales.

    FP8 data travels as its uint8 bit pattern so masked loads can fill with +0.0. A 4-bit code
    table (``BNB4``) travels in the global scale's place.
    """
    data = w.data.view(torch.uint8) if w.data.dtype == torch.float8_e4m3fn else w.data
    zeros = w.zeros if w.zeros is not None else w.scales
    global_scale = next(t for t in (w.global_scale, w.code_table, w.scales) if t is not None)
    return data, w.scales, zeros, global_scale


def dot_kernel_args(
    w: KernelWeight,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernel_args`` for the packed tensor-core paths: E4M3 scales (NVFP4) travel as bytes,
    decoded by bit operations in the dots' own layout (faster there on the H200; the one-row
    FMA path, where the hardware conversion was faster, keeps it: kernel notes,
    ``benchmarks/results/kernels_notes.md``)."""
    data, scales, zeros, global_scale = kernel_args(w)
    if scales.dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
        zeros = zeros if w.zeros is not None else scales
    return data, scales, zeros, global_scale


def kernel_constants(w: KernelWeight) -> dict[str, Any]:
    """The compile-time constants describing the weight's format."""
    return {
        "FAMILY": w.family,
        "PACKED": w.packed,
        "GROUP_N": w.group_n,
        "GROUP_K": w.group_k,
        "SCALE_E8M0": w.scale_e8m0,
        "HAS_ZEROS": w.zeros is not None,
        "GLOBAL_DIVIDE": w.global_divide,
    }


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Launch on ``device``'s GPU (so weights split across GPUs run where they live); switching
    the current device only when it is another one (an eager call saves the switch)."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(device):
            yield
    else:
        yield
