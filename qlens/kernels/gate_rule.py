"""How a fused experts module's gate|up rows combine, as the fused MoE decode reads it (no
Triton here: the modules describe their gates without importing the kernels)."""

from __future__ import annotations

from dataclasses import dataclass

# The activations the fused decode computes, by the code its kernel takes.
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}


@dataclass(frozen=True)
class GateRule:
    """``interleaved`` (``[g0, u0, g1, u1, ...]``) or stacked (``[gate; up]``) rows, and the
    activation, one of :data:`ACTIVATIONS`: ``silu(gate) * up``, or GPT-OSS'
    ``clamped_swiglu``, ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)``."""

    interleaved: bool
    activation: str
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"no fused kernel for the activation {self.activation!r}; fused ones: "
                f"{sorted(ACTIVATIONS)}"
            )
