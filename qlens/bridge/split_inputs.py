"""Per-head attention inputs: ``attn.hook_q_input``/``hook_k_input``/``hook_v_input`` and
``hook_attn_in`` ``[batch pos head d_model]``, as TransformerLens computes them.

The residual entering the layer is copied once per head, the hook fires on the copies, the
layer's input norm is applied to each copy and the projection to each; head ``h`` keeps its
own slice of its copy's projection. The projection module itself runs (so quantized
projections work), once per head: opt-in, and ``head`` times the projection's cost.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge.taps import Points, Site


def per_head_projection(
    proj: nn.Module, norm: nn.Module, forked: Float[Tensor, "batch pos head d_model"], d_head: int
) -> Float[Tensor, "batch pos head_d_head"]:
    """``proj(norm(forked[..., h, :]))`` restricted to head ``h``'s outputs, flattened."""
    projected = proj.forward(norm.forward(forked))  # [batch pos head head*d_head], no hooks
    heads = projected.unflatten(-1, (-1, d_head))  # [batch pos head head d_head]
    own = torch.diagonal(heads, dim1=-3, dim2=-2)  # [batch pos d_head head]
    return own.movedim(-1, -2).flatten(-2)


class SplitInputSite(Site):
    """The per-head input hooks of one layer, on its separate q/k/v projections.

    ``names`` = (q_input, k_input, v_input, attn_in); with ``attn_in`` the q copies feed q and
    the first ``n_kv_heads`` copies feed k and v.
    """

    def __init__(
        self,
        projections: tuple[nn.Module, nn.Module, nn.Module],
        norm: nn.Module,
        names: tuple[str, str, str, str],
        resid_pre: str,
        store: dict[str, Tensor],
        n_heads: int,
        n_kv_heads: int,
        d_head: int,
    ) -> None:
        self.projections, self.norm, self.names = projections, norm, names
        self.resid_pre, self.store = resid_pre, store
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_head

    def _forked(self, points: Points, role: int, n: int) -> Tensor:
        attn_in = self.names[3]
        if points[attn_in].is_active:
            key = attn_in + "/forked"
            if role == 0:  # q runs first: fire hook_attn_in once for the layer
                resid = self.store[self.resid_pre]
                copies = resid.unsqueeze(-2).expand(*resid.shape[:-1], self.n_heads, -1)
                self.store[key] = points[attn_in](copies.contiguous())
            return self.store[key][..., :n, :]
        resid = self.store[self.resid_pre]
        copies = resid.unsqueeze(-2).expand(*resid.shape[:-1], n, -1).contiguous()
        return points[self.names[role]](copies)

    def attach(self, points: Points) -> list[RemovableHandle]:
        handles = []
        for role, proj in enumerate(self.projections):
            n = self.n_heads if role == 0 else self.n_kv_heads

            def hook(
                _m: nn.Module, _args: Any, output: Tensor, role: int = role, n: int = n
            ) -> Tensor:
                if not (points[self.names[role]].is_active or points[self.names[3]].is_active):
                    return output
                forked = self._forked(points, role, n)
                return per_head_projection(self.projections[role], self.norm, forked, self.d_head)

            handles.append(proj.register_forward_hook(hook))
        return handles
