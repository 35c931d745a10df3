"""Modules whose weights are quantized payloads: QuantLinear and QuantExperts."""

from qlens.modules.expert_gate import ExpertGate
from qlens.modules.experts import QuantExperts
from qlens.modules.linear import QuantLinear

__all__ = ["ExpertGate", "QuantExperts", "QuantLinear"]
