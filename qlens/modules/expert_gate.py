"""How a fused experts module turns its gate|up projection into the down projection's input."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from jaxtyping import Float
from torch import Tensor

from qlens.kernels.gate_rule import ACTIVATIONS, GateRule

GATE_LAYOUTS = ("stacked", "interleaved")


@dataclass(frozen=True)
class ExpertGate:
    """Gating rule of a fused experts module.

    ``layout``: ``"stacked"`` rows are ``[gate; up]`` (Mixtral, Qwen3-MoE, FP8Experts),
    ``"interleaved"`` rows are ``[g0, u0, g1, u1, ...]`` (GPT-OSS). ``activation``: a transformers
    activation name (``act(gate) * up``) or ``"clamped_swiglu"`` (GPT-OSS:
    ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``).
    """

    layout: str
    activation: str
    alpha: float | None = None
    limit: float | None = None
    _act: ClassVar[Any]  # the activation module, set per instance (not a field)
    kernel_rule: ClassVar[GateRule | None]  # what the fused decode reads (not a field)

    def __post_init__(self) -> None:
        if self.layout not in GATE_LAYOUTS:
            raise ValueError(f"gate layout must be one of {GATE_LAYOUTS}; got {self.layout!r}")
        if self.activation == "clamped_swiglu":
            if self.alpha is None or self.limit is None:
                raise ValueError("the clamped_swiglu gate needs both alpha and limit")
        else:
            from transformers.activations import ACT2FN

            # Looked up once here, not on first use: torch.compile traces ``apply``.
            object.__setattr__(self, "_act", ACT2FN[self.activation])
        rule = None
        if self.activation in ACTIVATIONS:
            interleaved = self.layout == "interleaved"
            rule = GateRule(interleaved, self.activation, self.alpha or 0.0, self.limit or 0.0)
        object.__setattr__(self, "kernel_rule", rule)

    def split(
        self, gate_up: Float[Tensor, "*batch two_i"]
    ) -> tuple[Float[Tensor, "*batch i"], Float[Tensor, "*batch i"]]:
        """The gate and up halves of a gate|up projection output."""
        if self.layout == "interleaved":
            return gate_up[..., ::2], gate_up[..., 1::2]
        gate, up = gate_up.chunk(2, dim=-1)
        return gate, up

    def apply(self, gate_up: Float[Tensor, "*batch two_i"]) -> Float[Tensor, "*batch i"]:
        """The down projection's input."""
        gate, up = self.split(gate_up)
        if self.activation == "clamped_swiglu":
            alpha, limit = float(self.alpha or 0.0), float(self.limit or 0.0)  # both set (checked)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * (gate * alpha).sigmoid())
        return self._act(gate) * up

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
