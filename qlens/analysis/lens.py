"""Logit lens: the top tokens the unembedding reads from the residual stream at every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.weights import accessors


@dataclass
class LogitLens:
    """Top-k tokens per residual-stream layer at one position.

    ``token_ids`` and ``probs`` are ``[layer *batch k]``; ``labels`` name the layers
    (``"{i}_pre"`` ... ``"final_post"``).
    """

    token_ids: Int[Tensor, "layer *batch k"]
    probs: Float[Tensor, "layer *batch k"]
    labels: list[str]
    axes: tuple[str, ...]

    @property
    def values(self) -> Tensor:
        return self.probs

    def tokens_as_strings(self, bridge: Any) -> list[Any]:
        """The token ids decoded with the bridge's tokenizer, nested like ``token_ids``."""

        def decode(ids: Any) -> Any:
            if isinstance(ids, int):
                return bridge.to_string([ids])
            return [decode(i) for i in ids]

        return decode(self.token_ids.tolist())

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids.tolist(),
            "probs": self.probs.tolist(),
            "labels": list(self.labels),
            "axes": list(self.axes),
        }


def logit_lens(
    bridge: Any, cache: Any, *, pos: int = -1, k: int = 5, dequantize: bool = False
) -> LogitLens:
    """Apply the final norm and the unembedding to the residual before each layer and after the
    last one, at position ``pos``; keep the ``k`` most probable tokens of each."""
    resid, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    at_pos = resid[..., pos, :]  # [layer *batch d_model]
    w_u = accessors.W_U(bridge, dequantize=dequantize)
    b_u = accessors.b_U(bridge, dequantize=dequantize)
    logits = at_pos.to(w_u.dtype) @ w_u + b_u
    softcap = bridge.cfg.final_logit_softcapping
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    probs = logits.float().softmax(-1)
    top = probs.topk(k, dim=-1)
    axes = ("layer", *(["batch"] if top.values.ndim == 3 else []), "k")
    return LogitLens(top.indices, top.values, labels, axes)
