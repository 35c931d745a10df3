"""Modules whose weights are quantized payloads: QuantLinear and QuantExperts."""

from qlens.quant.modules.expert_gate import ExpertGate
from qlens.quant.modules.experts import QuantExperts
from qlens.quant.modules.linear import QuantLinear

__all__ = ["ExpertGate", "QuantExperts", "QuantLinear"]
