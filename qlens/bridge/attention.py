"""The qlens attention function, registered with transformers' attention interface.

While a bridge has attention-internal hooks active, the model's ``config._attn_implementation``
is switched to ``"qlens"``. For each attention module, the function either calls the model's
original attention function (SDPA for most families, HF eager where the family needs it) when
no internal hook of that layer is active, or computes attention eagerly, firing
``hook_q/k/v`` ``[batch pos head d_head]`` (k and v with the stored number of KV heads; with a
KV cache they hold every position attention reads), ``hook_attn_scores`` and ``hook_pattern``
``[batch head q_pos k_pos]`` and ``hook_z`` ``[batch pos head d_head]``.

Conventions: scores are scaled (and soft-capped where the family does so) with HF's additive
mask applied, so masked entries hold the dtype's minimum. With attention sinks (GPT-OSS),
``hook_pattern`` EXCLUDES the sink's probability mass: it is the weight each key actually
gets, rows sum to ``1 - p_sink``, and ``z = pattern @ v`` holds exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qlens.hooks import HookPoint

IMPLEMENTATION = "qlens"
INTERNAL_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")


@dataclass
class AttentionTap:
    """Per attention module: its original attention function and its internal hook points."""

    fast_fn: Callable[..., Any] | None  # set when a run starts
    points: dict[str, HookPoint] = field(default_factory=dict)  # keyed by short name

    @property
    def active(self) -> bool:
        return any(p.is_active for p in self.points.values())


_TAPS: dict[int, AttentionTap] = {}


def original_attention_fn(module: nn.Module, implementation: str | None) -> Callable[..., Any]:
    """The attention function the model would use under ``implementation``."""
    if implementation in (None, "eager"):
        family_module = sys.modules[type(module).__module__]
        return family_module.eager_attention_forward
    if implementation == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # Other kernels expect other mask formats; under qlens the mask is HF's eager mask.
    return sdpa_attention_forward


def install_tap(module: nn.Module, tap: AttentionTap) -> None:
    _TAPS[id(module)] = tap


def remove_tap(module: nn.Module) -> None:
    _TAPS.pop(id(module), None)


def _fire(tap: AttentionTap, name: str, x: Tensor) -> Tensor:
    point = tap.points.get(name)
    return point(x) if point is not None and point.is_active else x


def _needs_eager(kwargs: dict[str, Any], fn: Callable[..., Any] | None) -> bool:
    has_extras = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    return has_extras and fn is sdpa_attention_forward


def qlens_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Attention with hook points; inputs are ``[batch head pos d_head]`` as HF passes them."""
    tap = _TAPS.get(id(module))
    if tap is None:
        raise RuntimeError(
            f"qlens attention was called for {type(module).__name__} without a bridge tap; "
            "the model's config._attn_implementation is 'qlens' outside a bridge run. "
            "Set it back to 'sdpa' or 'eager'."
        )
    if tap.fast_fn is not None and not tap.active and not _needs_eager(kwargs, tap.fast_fn):
        return tap.fast_fn(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    return _eager_attention(
        module, tap, query, key, value, attention_mask, scaling, dropout, kwargs
    )


def _eager_attention(
    module: nn.Module,
    tap: AttentionTap,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor]:
    query = _fire(tap, "hook_q", query.transpose(1, 2)).transpose(1, 2)
    key = _fire(tap, "hook_k", key.transpose(1, 2)).transpose(1, 2)
    value = _fire(tap, "hook_v", value.transpose(1, 2)).transpose(1, 2)
    n_rep = query.shape[1] // key.shape[1]
    key_states, value_states = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = _apply_mask(scores, attention_mask)
    scores = _fire(tap, "hook_attn_scores", scores)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sink_logits = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        combined = torch.cat([scores, sink_logits], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        pattern = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32)
    pattern = pattern.to(value_states.dtype)
    if dropout and module.training:
        pattern = nn.functional.dropout(pattern, p=dropout, training=True)
    pattern = _fire(tap, "hook_pattern", pattern)
    z = torch.matmul(pattern, value_states).transpose(1, 2)
    z = _fire(tap, "hook_z", z)
    return z.contiguous(), pattern


def _apply_mask(scores: Tensor, mask: Tensor | None) -> Tensor:
    min_value = torch.finfo(scores.dtype).min
    if mask is None:
        q_len, k_len = scores.shape[-2:]
        offset = k_len - q_len
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(offset)
        return scores.masked_fill(~allowed, min_value)
    mask = mask[..., : scores.shape[-1]]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, min_value)
    return scores + mask


def register() -> None:
    """Register the qlens attention and mask functions with transformers (idempotent)."""
    if IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(IMPLEMENTATION, qlens_attention_forward)
    if IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, eager_mask)
