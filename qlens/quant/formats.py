"""Quantization formats as pure data: what a packed weight means, independent of any tensor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    """A weight quantization format.

    ``block`` is the (rows, cols) extent of the weight region that shares one scale, in logical
    ``[out, in]`` coordinates: ``(128, 128)`` for block FP8, ``(1, 32)`` for MX, ``(1, 16)`` for NVFP4,
    ``(1, group_size)`` for group-wise integers, ``(1, in)`` for per-row, ``(0, 0)`` for per-tensor.
    """

    name: str
    element: str  # "e4m3", "e2m1", "int4", "int8", "nf4", "fp4_bnb", "ternary", "higgs_vq", ...
    bits: int  # storage bits per weight element, excluding scales
    block: tuple[int, int]
    scale_dtype: str  # "fp32", "e8m0", "e4m3", "fp16", "bf16", "none"
    zero_point: str = "none"  # "none" | "int" | "float"
    global_scale: str = "none"  # "none" | "multiply" | "divide"
    description: str = ""

    def __str__(self) -> str:
        return self.name
