"""Next-token language-modelling loss over real (unpadded) tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor


def lm_loss(
    logits: Float[Tensor, "batch pos vocab"],
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"] | None = None,
    per_token: bool = False,
) -> Float[Tensor, "*batch_pos_minus_1"]:
    """Mean next-token cross-entropy over positions whose target is a real token (in float32,
    or float64 for float64 logits).

    ``per_token=True`` returns each position's loss ``[batch pos-1]`` (0 where masked) instead.
    """
    predictions = logits[:, :-1]  # in float32, or float64 for a float64 model
    log_probs = F.log_softmax(predictions.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    nll = -log_probs.gather(-1, tokens[:, 1:, None].to(logits.device))[..., 0]
    if mask is None:
        return nll if per_token else nll.mean()
    keep = (mask[:, 1:] * mask[:, :-1]).to(device=nll.device, dtype=nll.dtype)
    return nll * keep if per_token else (nll * keep).sum() / keep.sum()
