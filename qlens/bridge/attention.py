"""The qlens attention function, registered with transformers' attention interface.

While a bridge has attention-internal hooks active, the model's ``config._attn_implementation``
is switched to ``"qlens"``. For each attention module, the function calls the model's
original attention function (SDPA for most families, HF eager where the family needs it) and
fires the q/k/v hooks ``[batch pos head d_head]`` on its inputs (k and v with the stored number
of KV heads; with a KV cache they hold every position attention reads) and ``hook_z``
``[batch pos head d_head]`` on its output. The q/k inputs are rotated on rotary families, so
there they fire ``hook_rot_q``/``hook_rot_k`` (``hook_q``/``hook_k`` fire on the projections,
see ``qlens.bridge.projection_taps``); elsewhere ``hook_q``/``hook_k``. Only
``hook_attn_scores`` and ``hook_pattern`` ``[batch head q_pos k_pos]`` (or soft-capping / sinks,
which SDPA cannot apply) make it compute the scores explicitly.

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
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qlens.hooks import HookPoint

IMPLEMENTATION = "qlens"
# The values attention sees, each fired by one hook of the layer (see ``slot_hook_names``).
SLOTS = ("q", "k", "v", "scores", "pattern", "z")


def slot_hook_names(prefix: str, rotary: bool) -> dict[str, str]:
    """The hook name (``prefix`` = ``blocks.{i}.attn.``) fired for each slot."""
    rot = "rot_" if rotary else ""
    return {
        "q": f"{prefix}hook_{rot}q",
        "k": f"{prefix}hook_{rot}k",
        "v": f"{prefix}hook_v",
        "scores": f"{prefix}hook_attn_scores",
        "pattern": f"{prefix}hook_pattern",
        "z": f"{prefix}hook_z",
    }


@dataclass
class AttentionTap:
    """Per attention module: its original attention function and its internal hook points."""

    fast_fn: Callable[..., Any] | None  # set when a run starts
    points: dict[str, HookPoint] = field(default_factory=dict)  # keyed by slot

    @property
    def active(self) -> bool:
        return any(p.is_active for p in self.points.values())


_TAPS: dict[int, AttentionTap] = {}
# id(config) of the configs a bridge run has switched to qlens attention whose fast function is
# SDPA: their masks are built as SDPA's (None where ``is_causal`` serves), the others' as eager's.
_SDPA_MASKED: set[int] = set()


def original_attention_fn(module: nn.Module, implementation: str | None) -> Callable[..., Any]:
    """The attention function the model would use under ``implementation``."""
    if implementation in (None, "eager"):
        family_module = sys.modules[type(module).__module__]
        return family_module.eager_attention_forward
    if implementation == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # Other kernels expect other mask formats; under qlens they are served by SDPA and its masks.
    return sdpa_attention_forward


def mask_like_fast_path(config: Any, implementation: str | None) -> None:
    """Build ``config``'s masks for the fast function ``original_attention_fn`` gives for its
    ``implementation`` while qlens attention is switched on: SDPA's (``None`` when causal
    attention needs no mask, so SDPA keeps its fused causal kernels) or HF's eager additive
    mask for the eager function."""
    if implementation in (None, "eager"):
        _SDPA_MASKED.discard(id(config))
    else:
        _SDPA_MASKED.add(id(config))


def forget_mask_style(config: Any) -> None:
    _SDPA_MASKED.discard(id(config))


def qlens_mask(*args: Any, config: Any = None, **kwargs: Any) -> Tensor | None:
    """The mask function registered for qlens attention (see ``mask_like_fast_path``)."""
    if config is not None and id(config) in _SDPA_MASKED:
        return sdpa_mask(*args, config=config, **kwargs)
    return eager_mask(*args, config=config, **kwargs)


def install_tap(module: nn.Module, tap: AttentionTap) -> None:
    _TAPS[id(module)] = tap


def remove_tap(module: nn.Module) -> None:
    _TAPS.pop(id(module), None)


def _fire(tap: AttentionTap, name: str, x: Tensor) -> Tensor:
    point = tap.points.get(name)
    return point(x) if point is not None and point.is_active else x


EXPLICIT_SLOTS = ("scores", "pattern")


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
    """Attention with hook points; inputs are ``[batch head pos d_head]`` as HF passes them.

    Only ``hook_attn_scores``/``hook_pattern`` (or a family the fast function cannot serve)
    need explicit scores; the q/k/v/z hooks fire around the fast function otherwise.
    """
    tap = _TAPS.get(id(module))
    if tap is None:
        raise RuntimeError(
            f"qlens attention was called for {type(module).__name__} without a bridge tap; "
            "the model's config._attn_implementation is 'qlens' outside a bridge run. "
            "Set it back to 'sdpa' or 'eager'."
        )
    fast_fn = tap.fast_fn
    explicit = fast_fn is None or _needs_eager(kwargs, fast_fn)
    explicit = explicit or any(tap.points[slot].is_active for slot in EXPLICIT_SLOTS)
    if not explicit and fast_fn is not None:
        if not tap.active:
            return fast_fn(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
        query, key, value = _fire_qkv(tap, query, key, value)
        z, weights = fast_fn(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        return _fire(tap, "z", z), weights
    return _explicit_attention(
        module, tap, query, key, value, attention_mask, scaling, dropout, kwargs
    )


def _fire_qkv(
    tap: AttentionTap, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Fire the q/k/v slots on ``[batch pos head d_head]`` views; return ``[batch head pos d_head]``."""
    query = _fire(tap, "q", query.transpose(1, 2)).transpose(1, 2)
    key = _fire(tap, "k", key.transpose(1, 2)).transpose(1, 2)
    value = _fire(tap, "v", value.transpose(1, 2)).transpose(1, 2)
    return query, key, value


def _explicit_attention(
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
    """Scores, pattern and z with one batched matmul each way per layer.

    GQA is handled without repeating K/V: the queries of the heads that share a KV head are
    stacked along rows, ``[batch*kv_head, group*q_pos, d_head]``, whose product with that KV
    head's keys is the ``[batch head q_pos k_pos]`` scores in memory order.
    """
    query, key, value = _fire_qkv(tap, query, key, value)
    batch, n_heads, q_len, d_head = query.shape
    n_kv, k_len = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    if scaling is None:
        scaling = d_head**-0.5
    q_rows = (query * scaling).reshape(batch * n_kv, group * q_len, d_head)
    keys_t = key.reshape(batch * n_kv, k_len, d_head).transpose(1, 2)
    scores = torch.bmm(q_rows, keys_t).view(batch, n_heads, q_len, k_len)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        if scores.requires_grad:  # tanh's backward reads its output: no edits in place
            scores = torch.tanh(scores / softcap) * softcap
        else:
            scores.div_(softcap).tanh_().mul_(softcap)
    _mask_in_place(scores, attention_mask)
    scores = _fire(tap, "scores", scores)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        pattern = _pattern_without_sinks(scores, sinks)
    else:
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32)
    pattern = pattern.to(value.dtype)
    if dropout and module.training:
        pattern = nn.functional.dropout(pattern, p=dropout, training=True)
    pattern = _fire(tap, "pattern", pattern)
    z_rows = torch.bmm(
        pattern.reshape(batch * n_kv, group * q_len, k_len),
        value.reshape(batch * n_kv, k_len, d_head),
    )
    z = z_rows.view(batch, n_heads, q_len, d_head).transpose(1, 2).contiguous()
    return _fire(tap, "z", z), pattern


def _pattern_without_sinks(scores: Tensor, sinks: Tensor) -> Tensor:
    """Softmax over the keys and one sink logit per head; the sink's column is dropped."""
    sink_logits = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
    combined = torch.cat([scores, sink_logits], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def _mask_in_place(scores: Tensor, mask: Tensor | None) -> None:
    """Apply HF's mask to freshly computed scores; masked entries get the dtype's minimum."""
    min_value = torch.finfo(scores.dtype).min
    if mask is None:
        q_len, k_len = scores.shape[-2:]
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device)
        scores.masked_fill_(future.triu_(k_len - q_len + 1), min_value)
        return
    mask = mask[..., : scores.shape[-1]]
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, min_value)
    else:
        scores.add_(mask)


def register() -> None:
    """Register the qlens attention and mask functions with transformers (idempotent)."""
    if IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(IMPLEMENTATION, qlens_attention_forward)
    if IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, qlens_mask)
