"""Next-token language-modelling loss over real (unpadded) tokens."""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor


def lm_loss(
    logits: Float[Tensor, "batch pos vocab"],
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, ""]:
    """Mean next-token cross-entropy over positions whose target is a real token."""
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -log_probs.gather(-1, tokens[:, 1:, None].to(logits.device))[..., 0]
    if mask is None:
        return nll.mean()
    keep = (mask[:, 1:] * mask[:, :-1]).to(nll.dtype)
    return (nll * keep).sum() / keep.sum()
