"""The versions of a model a report compares: the reference and its quantized copies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.bridge import Bridge
from qlens.modules.model_quantize import SCHEMES, quantize
from qlens.quant.guards import quantization_method
from qlens.report.audit import WeightAudit, audit_weights

Role = Literal["reference", "quantized", "checkpoint"]


@dataclass
class Variant:
    """One version of the model: how it came to be, its weights and its logits on the prompt.

    ``role``: ``reference`` (a float model), ``quantized`` (a ``qlens.quantize`` copy of the
    reference with ``scheme``) or ``checkpoint`` (a model that was loaded already quantized;
    there is no float reference to compare it with).
    """

    label: str
    role: Role
    bridge: Bridge
    audit: WeightAudit
    logits: Float[Tensor, "batch pos vocab"]
    scheme: str | None = None


def check_schemes(schemes: Sequence[str]) -> list[str]:
    """The schemes in order without repeats; unknown names raise listing the known ones."""
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise ValueError(
            f"unknown quantization scheme {unknown[0]!r}; known schemes: {', '.join(SCHEMES)}"
        )
    return list(dict.fromkeys(schemes))


def base_variant(bridge: Bridge, logits: Float[Tensor, "batch pos vocab"]) -> Variant:
    """The loaded model: the float reference, or a checkpoint that is already quantized."""
    audit = audit_weights(bridge.model)
    if not audit.formats:
        return Variant("reference", "reference", bridge, audit, logits)
    method = quantization_method(getattr(bridge.model, "config", None))
    return Variant(
        f"checkpoint ({method or '/'.join(audit.formats)})", "checkpoint", bridge, audit, logits
    )


def quantized_variant(reference: Variant, scheme: str, tokens: Int[Tensor, "batch pos"]) -> Variant:
    """A copy of the reference quantized with ``scheme``, run on ``tokens``."""
    if reference.role != "reference":
        raise ValueError(
            f"the model is already quantized ({reference.label}), so it cannot be quantized "
            f"again with {scheme!r}; report it as it is (no schemes, --quant none on the "
            "command line) or start from its float checkpoint"
        )
    bridge = quantize(reference.bridge, scheme)
    with torch.no_grad():
        logits = bridge(tokens)
    return Variant(scheme, "quantized", bridge, audit_weights(bridge.model), logits, scheme)


def is_quantized(bridge: Bridge) -> bool:
    """Whether the model holds any quantized weight (it then is its own, quantized, version)."""
    return bool(audit_weights(bridge.model).formats)
