"""Per-head attention inputs: ``attn.hook_q_input``/``hook_k_input``/``hook_v_input`` and
``hook_attn_in`` ``[batch pos head d_model]``, as TransformerLens computes them.

The residual entering the layer is copied once per head, the hook fires on the copies, the
layer's input norm is applied to each copy and the projection to each; head ``h`` keeps its
own slice of its copy's projection. The projection module itself runs (so quantized
projections work), once per head: opt-in, and ``head`` times the projection's cost. A fused
qkv projection (GPT-2, GPT-NeoX, Phi-3) runs on the copies of each hooked role in turn, and each
keeps its own part of the fused output.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge.projection_taps import FusedQKV
from qlens.bridge.taps import Points, Site


def own_heads(
    projected: Float[Tensor, "batch pos copy copy_d_head"], d_head: int
) -> Float[Tensor, "batch pos copy_d_head"]:
    """Head ``h``'s outputs from copy ``h``'s projection, flattened back to ``[... head*d_head]``."""
    heads = projected.unflatten(-1, (-1, d_head))  # [batch pos copy head d_head]
    own = torch.diagonal(heads, dim1=-3, dim2=-2)  # [batch pos d_head head]
    return own.movedim(-1, -2).flatten(-2)


def per_head_projection(
    proj: nn.Module, norm: nn.Module, forked: Float[Tensor, "batch pos head d_model"], d_head: int
) -> Float[Tensor, "batch pos head_d_head"]:
    """``proj(norm(forked[..., h, :]))`` restricted to head ``h``'s outputs, flattened."""
    return own_heads(proj.forward(norm.forward(forked)), d_head)  # forward: no hooks


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

    def _forked(self, points: Points, role: int) -> Tensor:
        """The per-head copies feeding ``role`` (0 q, 1 k, 2 v), after their hook fired."""
        n = self.n_heads if role == 0 else self.n_kv_heads
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

    def _any_active(self, points: Points, role: int | None = None) -> bool:
        """Whether ``role``'s input hook (any role's, for None) or ``hook_attn_in`` is on."""
        roles = range(3) if role is None else (role,)
        return points[self.names[3]].is_active or any(
            points[self.names[r]].is_active for r in roles
        )

    def attach(self, points: Points) -> list[RemovableHandle]:
        handles = []
        for role, proj in enumerate(self.projections):

            def hook(_m: nn.Module, _args: Any, output: Tensor, role: int = role) -> Tensor:
                if not self._any_active(points, role):
                    return output
                forked = self._forked(points, role)
                return per_head_projection(self.projections[role], self.norm, forked, self.d_head)

            handles.append(proj.register_forward_hook(hook))
        return handles


class FusedSplitInputSite(SplitInputSite):
    """The per-head input hooks of one layer, on its fused qkv projection."""

    def __init__(
        self,
        qkv: nn.Module,
        fused: FusedQKV,
        norm: nn.Module,
        names: tuple[str, str, str, str],
        resid_pre: str,
        store: dict[str, Tensor],
    ) -> None:
        projections = (qkv, qkv, qkv)
        super().__init__(
            projections,
            norm,
            names,
            resid_pre,
            store,
            fused.n_heads,
            fused.n_kv_heads,
            fused.d_head,
        )
        self.fused = fused

    def attach(self, points: Points) -> list[RemovableHandle]:
        qkv = self.projections[0]

        def hook(_m: nn.Module, _args: Any, output: Tensor) -> Tensor:
            if not self._any_active(points):
                return output
            parts = self.fused.split(output)
            for role in range(3):  # q first: it fires hook_attn_in
                if self._any_active(points, role):
                    forked = self._forked(points, role)
                    projected = qkv.forward(self.norm.forward(forked))  # forward: no hooks
                    parts[role] = own_heads(self.fused.split(projected)[role], self.d_head)
            return self.fused.join(parts)

        return [qkv.register_forward_hook(hook)]
