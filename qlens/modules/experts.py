"""QuantExperts: drop-in quantized replacement for transformers' fused MoE experts modules."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from qlens.modules.dispatch import experts_w8a8_groups, fused_experts_forward
from qlens.modules.expert_gate import ExpertGate
from qlens.modules.payload_buffers import PayloadModule, traced_payload
from qlens.modules.traced_experts import traced_experts_forward
from qlens.quant.expert_payloads import num_experts_of
from qlens.quant.payload import QuantPayload


class QuantExperts(PayloadModule):
    """Fused experts with quantized ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]`` payloads.

    Replaces the experts module of Mixtral, Qwen3-MoE or GPT-OSS (and transformers' FP8Experts)
    with the same call: ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
    returns ``[T, H]``; the parent block still routes. Payloads use the logical ``[out, in]``
    orientation on every model (GPT-OSS' ``[E, in, out]`` weights are transposed when quantized);
    ``gate`` says how gate and up rows are laid out and combined. Each expert's matmul dispatches
    like :class:`~qlens.modules.QuantLinear`.

    ``w8a8=True`` (block FP8 payloads) rounds each projection's input to FP8 per token and K
    block first, as W8A8 experts (transformers' ``FP8Experts`` on a GPU) read it; the products
    then run on the weight-only kernels. A property, like ``QuantLinear.w8a8``.
    """

    def __init__(
        self,
        gate_up: QuantPayload,
        down: QuantPayload,
        gate: ExpertGate,
        gate_up_bias: Float[Tensor, "experts two_i"] | None = None,
        down_bias: Float[Tensor, "experts hidden"] | None = None,
        *,
        w8a8: bool = False,
    ) -> None:
        super().__init__()
        self._w8a8_groups: tuple[int, int] | None = None
        self.num_experts = num_experts_of(gate_up)
        _, two_i, self.hidden_dim = (int(s) for s in gate_up.shape)
        if two_i % 2:
            raise ValueError(f"gate_up payload has an odd output size {two_i}; expected 2 * I rows")
        self.intermediate_dim = two_i // 2
        expected_down = (self.num_experts, self.hidden_dim, self.intermediate_dim)
        if tuple(down.shape) != expected_down:
            raise ValueError(
                f"down payload has shape {list(down.shape)}; with gate_up {list(gate_up.shape)} it "
                f"must be [experts, hidden, intermediate] = {list(expected_down)}"
            )
        self.gate = gate
        self.register_payload("gate_up", gate_up)
        self.register_payload("down", down)
        self.gate_up_bias = _frozen(gate_up_bias)
        self.down_bias = _frozen(down_bias)
        self.w8a8 = w8a8

    @property
    def w8a8(self) -> bool:
        """Whether each projection's input is rounded to FP8 first (W8A8)."""
        return self._w8a8_groups is not None

    @w8a8.setter
    def w8a8(self, value: bool) -> None:
        specs = self._payload_specs
        self._w8a8_groups = experts_w8a8_groups(specs["gate_up"], specs["down"]) if value else None
        self.trace_with("gate_up", self._w8a8_groups)

    @property
    def payload(self) -> dict[str, QuantPayload]:
        """Both payloads by the HF parameter names (``qlens.dequantize(experts)`` reads this)."""
        return {"gate_up_proj": self.gate_up_payload, "down_proj": self.down_payload}

    def __getattr__(self, name: str) -> Any:
        if name in ("gate_up_proj", "down_proj"):
            raise AttributeError(
                f"QuantExperts holds quantized payloads, not a float {name}. Read them with "
                f"`.payload[{name!r}]`, or the float [experts, out, in] weights with "
                f"`qlens.dequantize(module)[{name!r}]`."
            )
        return super().__getattr__(name)

    @property
    def gate_up_payload(self) -> QuantPayload:
        return self.payload_for("gate_up")

    @property
    def down_payload(self) -> QuantPayload:
        return self.payload_for("down")

    def forward(
        self,
        hidden_states: Float[Tensor, "tokens hidden"],
        top_k_index: Integer[Tensor, "tokens k"] | None = None,
        top_k_weights: Float[Tensor, "tokens k"] | None = None,
        *,
        router_indices: Integer[Tensor, "tokens k"] | None = None,
        routing_weights: Float[Tensor, "tokens k"] | None = None,
    ) -> Float[Tensor, "tokens hidden"]:
        """Mixtral/Qwen3-MoE call ``(hidden, top_k_index, top_k_weights)``; GPT-OSS' keyword
        names ``router_indices``/``routing_weights`` are accepted too."""
        index = top_k_index if top_k_index is not None else router_indices
        weights = top_k_weights if top_k_weights is not None else routing_weights
        if index is None or weights is None:
            raise TypeError(
                "QuantExperts needs the routing: call experts(hidden_states, top_k_index, "
                "top_k_weights) with the indices and weights from the router"
            )
        if torch.compiler.is_compiling():
            return traced_experts_forward(
                hidden_states, index, weights,
                (*traced_payload(self._buffers, self._traced_gate_up), self.num_experts),
                traced_payload(self._buffers, self._traced_down),
                self.gate_up_bias, self.down_bias, self.gate.apply, self._traced_gate_up[2],
                self.gate.kernel_rule,
            )  # fmt: skip
        return fused_experts_forward(
            hidden_states, index, weights, self.experts_plan("gate_up", hidden_states),
            self.experts_plan("down", hidden_states), self.gate_up_bias, self.down_bias,
            self.gate.apply, self._w8a8_groups, self.gate.kernel_rule,
        )  # fmt: skip

    def extra_repr(self) -> str:
        gate_up, down = self.gate_up_payload, self.down_payload
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"intermediate_dim={self.intermediate_dim}, format={gate_up.format.name}, "
            f"gate={self.gate.layout}/{self.gate.activation}, bias={self.gate_up_bias is not None}, "
            f"{(gate_up.nbytes + down.nbytes) * 8 / (gate_up.numel + down.numel):.2f} bits/weight"
            + (", w8a8=True" if self.w8a8 else "")
        )


def _frozen(t: Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=False)
