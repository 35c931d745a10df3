"""Analyses on cached forwards: residual decompositions, logit attribution and lens, head
detection, activation patching and quantization drift. Weights are read through the guarded
accessors of ``qlens.weights``."""

from qlens.analysis.drift import DriftReport, quantization_drift
from qlens.analysis.heads import HEAD_KINDS, head_scores, repeated_random_tokens, score_patterns
from qlens.analysis.labeled import Labeled
from qlens.analysis.lens import LogitLens, logit_lens
from qlens.analysis.patching import logit_diff_metric, patch_by_position, patch_heads
from qlens.analysis.resid import (
    apply_ln_to_stack,
    decompose_resid,
    get_full_resid_decomposition,
    logit_attrs,
    stack_head_results,
)
from qlens.analysis.slicing import Slice

__all__ = [
    "HEAD_KINDS",
    "DriftReport",
    "Labeled",
    "LogitLens",
    "Slice",
    "apply_ln_to_stack",
    "decompose_resid",
    "get_full_resid_decomposition",
    "head_scores",
    "logit_attrs",
    "logit_diff_metric",
    "logit_lens",
    "patch_by_position",
    "patch_heads",
    "quantization_drift",
    "repeated_random_tokens",
    "score_patterns",
    "stack_head_results",
]
