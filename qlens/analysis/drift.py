"""Quantization drift: how far a quantized model's internals move from a reference model's.

Works for any pair of bridges over the same architecture and tokenizer: a model and its
``qlens.quantize`` copy, or a float checkpoint and an adopted quantized checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor


@dataclass
class DriftReport:
    """Per-layer residual drift, per-head attention change and output agreement.

    ``resid_cosine``/``resid_rel_error``: per layer (``hook_resid_post``), the mean over tokens of
    the cosine similarity and of ``||quantized - reference|| / ||reference||``.
    ``pattern_change``: per ``[layer][head]``, the mean over query positions of the total
    variation distance between the two attention distributions (0 = identical, 1 = disjoint).
    ``logit_kl``: mean over tokens of KL(reference || quantized) of the next-token
    distributions, in nats. ``top1_agreement``: fraction of tokens with the same argmax;
    ``topk_overlap``: mean fraction of shared tokens among the top ``k``.
    """

    n_tokens: int
    resid_cosine: list[float]
    resid_rel_error: list[float]
    pattern_change: list[list[float]]
    logit_kl: float
    top1_agreement: float
    topk_overlap: float
    k: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of the report."""
        return asdict(self)


def _cosine(a: Tensor, b: Tensor) -> Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1.0, 1.0)


def _relative_error(reference: Tensor, other: Tensor) -> Tensor:
    ref = reference.float()
    return (other.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def pattern_change(
    reference: Float[Tensor, "batch head q k"], other: Float[Tensor, "batch head q k"]
) -> Float[Tensor, " head"]:
    """Mean total variation distance between attention patterns, per head."""
    return 0.5 * (reference.float() - other.float()).abs().sum(-1).mean((0, 2))


def logit_agreement(
    reference: Float[Tensor, "*tokens vocab"], other: Float[Tensor, "*tokens vocab"], k: int
) -> tuple[float, float, float]:
    """(mean KL(reference || other), top-1 agreement, top-k overlap) over all tokens."""
    ref_logp = reference.float().log_softmax(-1).reshape(-1, reference.shape[-1])
    oth_logp = other.float().log_softmax(-1).reshape(-1, other.shape[-1])
    kl = F.kl_div(oth_logp, ref_logp, log_target=True, reduction="none").sum(-1)
    top1 = (ref_logp.argmax(-1) == oth_logp.argmax(-1)).float().mean()
    ref_top, oth_top = ref_logp.topk(k, -1).indices, oth_logp.topk(k, -1).indices
    overlap = (ref_top[:, :, None] == oth_top[:, None, :]).any(-1).float().mean()
    return float(kl.mean()), float(top1), float(overlap)


def quantization_drift(reference: Any, quantized: Any, tokens: Any, *, k: int = 5) -> DriftReport:
    """Run both bridges on ``tokens`` (ids ``[batch pos]`` or text) and compare them."""
    if reference.cfg.n_layers != quantized.cfg.n_layers:
        raise ValueError(
            f"the models differ in depth ({reference.cfg.n_layers} vs "
            f"{quantized.cfg.n_layers} layers): drift compares the same architecture"
        )
    if reference.cfg.d_vocab != quantized.cfg.d_vocab:
        raise ValueError("the models have different vocabularies; drift needs the same tokenizer")
    if not isinstance(tokens, Tensor):
        tokens = reference.to_tokens(tokens)

    def wanted(name: str) -> bool:
        return name.endswith(("hook_resid_post", "attn.hook_pattern"))

    with torch.no_grad():
        ref_logits, ref = reference.run_with_cache(tokens, names_filter=wanted)
        q_logits, quant = quantized.run_with_cache(tokens, names_filter=wanted)
    cosines, errors, changes = [], [], []
    for i in range(reference.cfg.n_layers):
        r, q = ref[f"blocks.{i}.hook_resid_post"], quant[f"blocks.{i}.hook_resid_post"]
        cosines.append(float(_cosine(r, q.to(r.device)).mean()))
        errors.append(float(_relative_error(r, q.to(r.device)).mean()))
        p_ref = ref[f"blocks.{i}.attn.hook_pattern"]
        changes.append(
            pattern_change(p_ref, quant[f"blocks.{i}.attn.hook_pattern"].to(p_ref.device)).tolist()
        )
    kl, top1, overlap = logit_agreement(ref_logits, q_logits.to(ref_logits.device), k)
    return DriftReport(
        n_tokens=int(tokens.numel()),
        resid_cosine=cosines,
        resid_rel_error=errors,
        pattern_change=changes,
        logit_kl=kl,
        top1_agreement=top1,
        topk_overlap=overlap,
        k=k,
    )
