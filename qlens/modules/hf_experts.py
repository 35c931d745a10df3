"""Read transformers' fused float experts modules (Mixtral, Qwen3-MoE, GPT-OSS...) in [out, in] form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from qlens.modules.expert_gate import ExpertGate


@dataclass
class FusedExpertWeights:
    """A fused experts module's float weights in logical ``[experts, out, in]`` orientation."""

    gate_up: Float[Tensor, "experts two_i hidden"]
    down: Float[Tensor, "experts hidden i"]
    gate: ExpertGate
    gate_up_bias: Float[Tensor, "experts two_i"] | None
    down_bias: Float[Tensor, "experts hidden"] | None


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds 3-D ``gate_up_proj`` and ``down_proj`` tensors (a fused experts module)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.ndim == down.ndim == 3
    )


def _is_gpt_oss_style(module: nn.Module) -> bool:
    """GPT-OSS experts: clamped SwiGLU (``alpha``, ``limit``) with biases, in every version."""
    return all(
        getattr(module, n, None) is not None for n in ("alpha", "limit", "gate_up_proj_bias")
    )


def expert_gate_of(module: nn.Module) -> ExpertGate | str:
    """The gating rule of a transformers experts module, or why qlens cannot reproduce it."""
    concatenated = getattr(module, "is_concatenated", None)
    if _is_gpt_oss_style(module):
        layout = "stacked" if concatenated else "interleaved"
        m: Any = module
        return ExpertGate(layout, "clamped_swiglu", float(m.alpha), float(m.limit))
    own_gate = getattr(type(module), "_apply_gate", None)
    if (
        own_gate is not None
        and getattr(own_gate, "__module__", "") != "transformers.integrations.moe"
    ):
        return f"its gating ({type(module).__qualname__}._apply_gate) is not one qlens reproduces"
    if not getattr(module, "has_gate", True):
        return "it has no gate projection (up_proj only)"
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act is None:
        return "its activation is unknown (no config.hidden_act)"
    return ExpertGate("interleaved" if concatenated is False else "stacked", str(act))


def read_fused_experts(module: nn.Module) -> FusedExpertWeights | str:
    """The module's weights as ``[E, out, in]`` with its gate rule, or why they cannot be read."""
    if not is_fused_experts(module):
        return "it has no 3-D gate_up_proj/down_proj tensors"
    gate = expert_gate_of(module)
    if isinstance(gate, str):
        return gate
    gate_up: Tensor = getattr(module, "gate_up_proj")  # noqa: B009 (checked above: tensors)
    down: Tensor = getattr(module, "down_proj")  # noqa: B009
    if not (gate_up.is_floating_point() and gate_up.element_size() >= 2):
        return f"its weights are {gate_up.dtype}, not float (already quantized)"
    if getattr(module, "is_transposed", _is_gpt_oss_style(module)):
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    (_, two_i, hidden), (_, hidden_out, i) = gate_up.shape, down.shape
    if two_i != 2 * i or hidden != hidden_out:
        return (
            f"its weights gate_up {list(gate_up.shape)} / down {list(down.shape)} are not "
            f"[E, 2I, H] / [E, H, I] in the orientation qlens inferred"
        )
    return FusedExpertWeights(
        gate_up=gate_up.detach(),
        down=down.detach(),
        gate=gate,
        gate_up_bias=_bias(module, "gate_up_proj_bias"),
        down_bias=_bias(module, "down_proj_bias"),
    )


def _bias(module: nn.Module, name: str) -> Tensor | None:
    value = getattr(module, name, None)
    return value.detach() if isinstance(value, torch.Tensor) else None
