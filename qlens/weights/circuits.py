"""Per-head QK and OV circuits as FactoredMatrix, and TransformerLens composition scores."""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.weights import accessors
from qlens.weights.factored import FactoredMatrix

CompositionMode = Literal["Q", "K", "V"]


def QK_circuit(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> FactoredMatrix:
    """``W_Q @ W_K^T`` per query head ``[(layer) head d_model d_model]`` (K repeated per head).

    Rotary position rotations and q/k norms are not part of the weights and are not included.
    """
    w_q = accessors.W_Q(bridge, layer, dequantize=dequantize)
    w_k = accessors.W_K(bridge, layer, repeat_kv=True, dequantize=dequantize)
    return FactoredMatrix(w_q, w_k.transpose(-2, -1))


def OV_circuit(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> FactoredMatrix:
    """``W_V @ W_O`` per head ``[(layer) head d_model d_model]`` (V repeated per query head)."""
    w_v = accessors.W_V(bridge, layer, repeat_kv=True, dequantize=dequantize)
    return FactoredMatrix(w_v, accessors.W_O(bridge, layer, dequantize=dequantize))


def _r_factor(m: Tensor) -> Tensor:
    """``R`` of ``m = Q R``: ``||m @ X||_F == ||R @ X||_F`` for any ``X``."""
    return torch.linalg.qr(m.float(), mode="r")[1]


def composition_scores(
    left: FactoredMatrix, right: FactoredMatrix
) -> Float[Tensor, "*batch_and_batch"]:
    """``||L R||_F / (||L||_F ||R||_F)`` for every pair of a left and a right matrix.

    The result has shape ``left.shape[:-2] + right.shape[:-2]``. Only the small inner factors are
    multiplied: the norms go through the ``R`` factors of QR decompositions of the outer factors.
    """
    lead_l, lead_r = left.shape[:-2], right.shape[:-2]
    la = _r_factor(left.A.reshape(-1, *left.A.shape[-2:]))  # [nl, m, m]
    lb = left.B.reshape(-1, *left.B.shape[-2:]).float()  # [nl, m, d]
    ra = right.A.reshape(-1, *right.A.shape[-2:]).float()  # [nr, d, m']
    rb = _r_factor(right.B.reshape(-1, *right.B.shape[-2:]).transpose(-2, -1))  # [nr, m', m']
    left_inner = la @ lb  # ||L|| = ||la lb||
    right_inner = ra @ rb.transpose(-2, -1)  # ||R|| = ||ra rb^T||
    left_norms = left_inner.norm(dim=(-2, -1))
    right_norms = right_inner.norm(dim=(-2, -1))
    rows = []
    for i in range(left_inner.shape[0]):  # one left matrix at a time bounds the memory
        core = left_inner[i] @ right_inner  # [nr, m, m']
        rows.append(core.norm(dim=(-2, -1)))
    scores = torch.stack(rows) / left_norms[:, None] / right_norms[None, :]
    return scores.reshape(*lead_l, *lead_r)


def all_composition_scores(
    bridge: Any, mode: CompositionMode, *, dequantize: bool = False
) -> Float[Tensor, "left_layer left_head right_layer right_head"]:
    """Q-, K- or V-composition of every earlier head's OV circuit into every later head.

    As in TransformerLens: left is the OV circuit; right is the QK circuit (``"Q"``), its
    transpose (``"K"``) or the OV circuit (``"V"``). Pairs whose right head is not in a strictly
    later layer are 0.
    """
    ov = OV_circuit(bridge, dequantize=dequantize)
    if mode == "Q":
        right = QK_circuit(bridge, dequantize=dequantize)
    elif mode == "K":
        right = QK_circuit(bridge, dequantize=dequantize).T
    elif mode == "V":
        right = ov
    else:
        raise ValueError(f"mode must be 'Q', 'K' or 'V', got {mode!r}")
    scores = composition_scores(ov, right)
    n_layers = scores.shape[0]
    layer = torch.arange(n_layers, device=scores.device)
    later = layer[None, None, :, None] > layer[:, None, None, None]
    return torch.where(later, scores, torch.zeros_like(scores))
