"""Triton kernels for quantized weights: fused linear layers and dequantization.

``linear`` is the one dispatcher: the fused kernels, a Triton dequantize then cuBLAS, or the
torch reference, chosen once per payload and device (``LinearPlan``). ``quantized_linear``
picks a decode (split-K) path for small batches and a GEMM path for large ones;
``experts_linear`` runs mixture-of-experts weights grouped by expert; ``reference_linear`` is
the torch reference for every device. Triton itself is imported only when a kernel runs, so
the reference works without it. Importing ``qlens.kernels`` registers the ``qlens::`` ops
(``qlens.kernels.ops``) that ``torch.compile`` sees.
"""

from __future__ import annotations

from typing import Any

from qlens.kernels import ops as ops  # registers the qlens:: ops
from qlens.kernels.configs import LinearConfig, choose_config
from qlens.kernels.dispatch import dequantized_linear, quantized_linear, supports
from qlens.kernels.experts import experts_linear
from qlens.kernels.plan import LinearPlan, linear
from qlens.kernels.reference import reference_linear

__all__ = [
    "DequantLaunch",
    "LinearConfig",
    "LinearPlan",
    "choose_config",
    "dequantize_triton",
    "dequantized_linear",
    "experts_linear",
    "linear",
    "quantized_linear",
    "reference_linear",
    "supports",
]


def __getattr__(name: str) -> Any:
    if name == "dequantize_triton":
        from qlens.kernels.dequant import dequantize_triton

        return dequantize_triton
    if name == "DequantLaunch":
        from qlens.kernels.dequant_launch import DequantLaunch

        return DequantLaunch
    raise AttributeError(f"module 'qlens.kernels' has no attribute {name!r}")
