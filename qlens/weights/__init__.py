"""Weight-space utilities: guarded accessors, FactoredMatrix, circuits and weight processing.

Every weight is read through ``qlens.weights.access`` (``read_weight``), which raises on
quantized or non-materialized weights unless dequantization is opted into with
``dequantize=True`` or ``with qlens.weights.dequantized(bridge):``.
"""

from qlens.weights.access import (
    ExpertWeights,
    dequantized,
    read_experts,
    read_tensor,
    read_weight,
)
from qlens.weights.accessors import (
    W_E,
    W_K,
    W_O,
    W_Q,
    W_U,
    W_V,
    W_gate,
    W_in,
    W_out,
    W_pos,
    W_router,
    W_shared_expert_gate,
    b_gate,
    b_in,
    b_K,
    b_O,
    b_out,
    b_Q,
    b_router,
    b_U,
    b_V,
    experts,
)
from qlens.weights.circuits import (
    OV_circuit,
    QK_circuit,
    all_composition_scores,
    composition_scores,
)
from qlens.weights.factored import FactoredMatrix
from qlens.weights.materialize import Processed, ProcessingSummary
from qlens.weights.processing import (
    center_unembed,
    center_writing_weights,
    fold_layer_norm,
    fold_value_biases,
    process_weights,
)
from qlens.weights.storage import unreadable_weights

__all__ = [
    "W_E",
    "W_K",
    "W_O",
    "W_Q",
    "W_U",
    "W_V",
    "ExpertWeights",
    "FactoredMatrix",
    "OV_circuit",
    "Processed",
    "ProcessingSummary",
    "QK_circuit",
    "W_gate",
    "W_in",
    "W_out",
    "W_pos",
    "W_router",
    "W_shared_expert_gate",
    "all_composition_scores",
    "b_K",
    "b_O",
    "b_Q",
    "b_U",
    "b_V",
    "b_gate",
    "b_in",
    "b_out",
    "b_router",
    "center_unembed",
    "center_writing_weights",
    "composition_scores",
    "dequantized",
    "experts",
    "fold_layer_norm",
    "fold_value_biases",
    "process_weights",
    "read_experts",
    "read_tensor",
    "read_weight",
    "unreadable_weights",
]
