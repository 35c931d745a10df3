"""``attn.hook_q`` / ``hook_k`` on rotary families: the projections' outputs, before rotary.

As in TransformerLens, they are ``[batch pos head d_head]`` views of what the q/k projections
return, before any q/k norm (Qwen3, Gemma 3) and before rotary; ``hook_rot_q``/``hook_rot_k``
(fired by qlens attention) hold the rotated values. An edit flows through the norm and rotary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge.adapters.base import QKVLayout
from qlens.bridge.taps import Points, Site, wants_grad


def _fire_heads(points: Points, name: str, flat: Tensor, d_head: int) -> Tensor:
    """Fire ``name`` on ``[... head*d_head]`` seen as ``[... head d_head]``; same layout back."""
    point = points.get(name)
    if point is None or not point.is_active:
        return flat
    heads = flat.unflatten(-1, (-1, d_head))
    new = point(heads)
    return flat if new is heads and not wants_grad(points, name) else new.flatten(-2)


class ProjectionHeadsSite(Site):
    """One projection module's output as ``[batch pos head d_head]`` under ``name``."""

    def __init__(self, module: nn.Module, name: str, d_head: int) -> None:
        self.module, self.names, self.d_head = module, (name,), d_head

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]

        def hook(_m: nn.Module, _args: Any, output: Tensor) -> Tensor:
            return _fire_heads(points, name, output, self.d_head)

        return [self.module.register_forward_hook(hook)]


@dataclass(frozen=True)
class FusedQKV:
    """Where q, k and v sit in a fused qkv projection's output ``[... out]``.

    ``qkv_blocks``: ``[all q | all k | all v]`` (GPT-2, Phi-3); ``per_head_qkv``: each head's
    ``[q | k | v]`` (GPT-NeoX).
    """

    layout: QKVLayout
    n_heads: int
    n_kv_heads: int
    d_head: int

    def split(self, output: Tensor) -> list[Tensor]:
        """q, k, v as ``[... head*d_head]`` (per-head layout: gathered from each head)."""
        if self.layout == "per_head_qkv":
            per_head = output.unflatten(-1, (self.n_heads, 3, self.d_head))
            return [per_head[..., i, :].flatten(-2) for i in range(3)]
        q_width, kv_width = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return list(output.split([q_width, kv_width, kv_width], dim=-1))

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """The fused output holding ``parts`` = q, k, v ``[... head*d_head]``."""
        if self.layout == "per_head_qkv":
            heads = [p.unflatten(-1, (self.n_heads, self.d_head)) for p in parts]
            return torch.stack(heads, dim=-2).flatten(-3)
        return torch.cat(list(parts), dim=-1)


class FusedQKSite(Site):
    """``hook_q`` and ``hook_k`` on a fused qkv projection's output."""

    def __init__(self, module: nn.Module, q_name: str, k_name: str, fused: FusedQKV) -> None:
        self.module, self.names, self.fused = module, (q_name, k_name), fused

    def attach(self, points: Points) -> list[RemovableHandle]:
        q_name, k_name = self.names
        d_head = self.fused.d_head

        def hook(_m: nn.Module, _args: Any, output: Tensor) -> Tensor:
            q, k, v = self.fused.split(output)
            new_q = _fire_heads(points, q_name, q, d_head)
            new_k = _fire_heads(points, k_name, k, d_head)
            if new_q is q and new_k is k and not wants_grad(points, q_name, k_name):
                return output
            return self.fused.join([new_q, new_k, v])

        return [self.module.register_forward_hook(hook)]
