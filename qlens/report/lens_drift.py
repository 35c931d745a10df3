"""Per-layer logit KL: how far a quantized model's logit-lens distributions move from the
reference's after each layer (``qlens.analysis.logit_lens`` over the whole vocabulary)."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.analysis import logit_lens
from qlens.bridge import ActivationCache, Bridge

_TINY = torch.finfo(torch.float32).tiny  # probabilities that underflowed to 0 count as this


def lens_probabilities(bridge: Bridge, cache: ActivationCache) -> Float[Tensor, "layer pos vocab"]:
    """Next-token distribution read by the logit lens after each layer, at every position.

    Row ``i`` is the residual stream after layer ``i`` (the final one through the final norm as
    the model applies it). The unembedding is dequantized if it is quantized.
    """
    n_pos = cache["blocks.0.hook_resid_post"].shape[1]
    per_position = []
    for pos in range(n_pos):
        lens = logit_lens(bridge, cache, pos=pos, k=bridge.cfg.d_vocab, dequantize=True)
        probs = torch.zeros(lens.probs.shape).scatter_(-1, lens.token_ids.cpu(), lens.probs.cpu())
        per_position.append(probs.reshape(probs.shape[0], -1, probs.shape[-1])[1:, 0])
    return torch.stack(per_position, dim=1)


def layer_logit_kl(
    reference: Float[Tensor, "layer pos vocab"], other: Float[Tensor, "layer pos vocab"]
) -> Float[Tensor, " layer"]:
    """KL(reference || other) in nats per layer, averaged over positions."""
    log_ratio = reference.clamp_min(_TINY).log() - other.clamp_min(_TINY).log()
    return (reference * log_ratio).sum(-1).mean(-1)


def quantized_lens_kl(
    reference_probs: Float[Tensor, "layer pos vocab"],
    quantized: Bridge,
    tokens: Int[Tensor, "batch pos"],
) -> list[float]:
    """Per-layer logit-lens KL(reference || quantized) on ``tokens`` (batch 1), given the
    reference's :func:`lens_probabilities` on the same tokens."""
    with torch.no_grad():
        _, cache = quantized.run_with_cache(tokens, return_cache_object=True)
    assert isinstance(cache, ActivationCache)
    return layer_logit_kl(reference_probs, lens_probabilities(quantized, cache)).tolist()
