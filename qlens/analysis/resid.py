"""Residual-stream decompositions of a cached forward, and their direct logit attribution.

Components are stacked on a leading ``component`` dim with string labels; they sum to the
residual stream (``hook_resid_pre`` of ``layer``, or the final residual when ``layer=None``).
Weights (W_O, W_out, W_U) are read through the guarded accessors.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.analysis.labeled import Labeled
from qlens.weights import accessors
from qlens.weights.access import read_optional


def _layer_count(bridge: Any, layer: int | None) -> int:
    n = bridge.cfg.n_layers
    if layer is None:
        return n
    if not 0 <= layer <= n:
        raise ValueError(f"layer must be in [0, {n}] (or None for the final residual), got {layer}")
    return layer


def _branch(cache: Any, layer: int, kind: str) -> Tensor:
    """What the residual receives from a layer's attention or MLP (after any sandwich norm)."""
    post = "ln1_post" if kind == "attn" else "ln2_post"
    name = f"blocks.{layer}.{post}.hook_normalized"
    return cache[name] if name in cache else cache[f"blocks.{layer}.hook_{kind}_out"]


def _has_sandwich_norms(bridge: Any) -> bool:
    return bridge.adapter.layer.ln1_post is not None


def decompose_resid(
    bridge: Any,
    cache: Any,
    layer: int | None = None,
    *,
    mode: str = "all",
    incl_embeds: bool = True,
) -> Labeled:
    """The residual stream as embed, pos_embed and each layer's attention and MLP outputs.

    ``mode`` keeps ``"all"``, ``"attn"`` or ``"mlp"`` outputs. Values are
    ``[component *batch pos d_model]``.
    """
    if mode not in ("all", "attn", "mlp"):
        raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
    parts, labels = _embeds(cache) if incl_embeds else ([], [])
    for i in range(_layer_count(bridge, layer)):
        for kind in ("attn", "mlp"):
            if mode in ("all", kind):
                parts.append(_branch(cache, i, kind))
                labels.append(f"{i}_{kind}_out")
    return _stack(parts, labels)


def _embeds(cache: Any) -> tuple[list[Tensor], list[str]]:
    embed = cache["hook_embed"]
    parts, labels = [embed], ["embed"]
    if "hook_pos_embed" in cache:  # may be [1 pos d_model] for a batch
        parts.append(cache["hook_pos_embed"].expand_as(embed))
        labels.append("pos_embed")
    return parts, labels


def _stack(parts: list[Tensor], labels: list[str]) -> Labeled:
    values = torch.stack(parts)
    axes = ("component", *(["batch"] if values.ndim == 4 else []), "pos", "d_model")
    return Labeled(values, axes, {"component": labels})


def stack_head_results(
    bridge: Any, cache: Any, layer: int | None = None, *, dequantize: bool = False
) -> Labeled:
    """Each head's output ``z_h @ W_O[h]`` for the layers before ``layer`` (bias excluded).

    Values are ``[component *batch pos d_model]``, labels ``L{layer}H{head}``; needs
    ``attn.hook_z`` in the cache. W_O is read through the guard (``dequantize`` opts in).
    """
    parts: list[Tensor] = []
    labels: list[str] = []
    for i in range(_layer_count(bridge, layer)):
        z = cache[f"blocks.{i}.attn.hook_z"]
        w_o = accessors.W_O(bridge, i, dequantize=dequantize).to(z.dtype)
        result = torch.einsum("...hd,hdm->h...m", z, w_o)
        parts.extend(result.unbind(0))
        labels += [f"L{i}H{h}" for h in range(w_o.shape[0])]
    if not parts:
        raise ValueError("stack_head_results needs at least one layer (layer >= 1 or None)")
    return _stack(parts, labels)


def get_full_resid_decomposition(
    bridge: Any,
    cache: Any,
    layer: int | None = None,
    *,
    expand_neurons: bool = False,
    dequantize: bool = False,
) -> Labeled:
    """The residual as every head, every MLP (or every neuron), the embeddings and the biases.

    Components: each head (``L{i}H{h}``), each MLP (``{i}_mlp_out``) or with
    ``expand_neurons`` each neuron (``L{i}N{n}``) plus the MLP output biases, the embeddings, and
    ``bias`` (the sum of the attention output biases). Sandwich-norm families (Gemma 2/3) are
    refused: their post-norms make the residual a non-linear function of the heads.
    """
    if _has_sandwich_norms(bridge):
        raise ValueError(
            f"a {bridge.cfg.family} model normalizes each attention/MLP output before adding it "
            "to the residual (sandwich norms), so the residual is not a sum of per-head or "
            "per-neuron terms; use decompose_resid for per-layer components"
        )
    n = _layer_count(bridge, layer)
    heads = stack_head_results(bridge, cache, n, dequantize=dequantize) if n else None
    parts = list(heads.values.unbind(0)) if heads is not None else []
    labels = list(heads.labels["component"]) if heads is not None else []
    bias = torch.zeros_like(cache["hook_embed"])
    for i in range(n):
        bias = bias + accessors.b_O(bridge, i, dequantize=dequantize).to(bias.dtype)
        if not expand_neurons:
            parts.append(_branch(cache, i, "mlp"))
            labels.append(f"{i}_mlp_out")
            continue
        if accessors.layer_module(bridge, i, "experts") is not None:
            raise ValueError(
                f"expand_neurons is not defined for the mixture-of-experts layer {i}; "
                "use expand_neurons=False"
            )
        post = cache[f"blocks.{i}.mlp.hook_post"]
        w_out = accessors.W_out(bridge, i, dequantize=dequantize).to(post.dtype)
        neurons = post[..., :, None] * w_out  # [*batch pos d_mlp d_model]
        parts.extend(neurons.movedim(-2, 0).unbind(0))
        labels += [f"L{i}N{j}" for j in range(w_out.shape[0])]
        bias = bias + accessors.b_out(bridge, i, dequantize=dequantize).to(bias.dtype)
    embeds, embed_labels = _embeds(cache)
    return _stack([*parts, *embeds, bias], [*labels, *embed_labels, "bias"])


def _norm_for(bridge: Any, layer: int | None, mlp_input: bool) -> tuple[Any, str]:
    if layer is None or layer == bridge.cfg.n_layers:
        return bridge.ln_final, "ln_final.hook_scale"
    field = "ln2" if mlp_input else "ln1"
    return accessors.layer_module(bridge, layer, field), f"blocks.{layer}.{field}.hook_scale"


def apply_ln_to_stack(
    bridge: Any,
    cache: Any,
    residual_stack: Float[Tensor, "component *batch_pos d_model"],
    layer: int | None = None,
    *,
    mlp_input: bool = False,
) -> Float[Tensor, "component *batch_pos d_model"]:
    """Apply the norm in front of ``layer`` (final norm when None) to each component linearly.

    Each component is centered (LayerNorm), divided by the cached ``hook_scale`` of the full
    residual and multiplied by the norm's weight (Gemma: ``1 + w``). The norm's bias is not
    attributable to any component and is left out; fold it with
    ``qlens.weights.process_weights`` to move it into the next layer's biases.
    """
    norm, scale_name = _norm_for(bridge, layer, mlp_input)
    scale = cache[scale_name]
    stack = residual_stack
    if bridge.cfg.normalization_type == "LN":
        stack = stack - stack.mean(-1, keepdim=True)
    stack = stack / scale.to(stack.dtype)
    weight = read_optional(norm, "weight", operation="apply a norm to a residual stack")
    if weight is not None:
        stack = stack * (weight.to(stack.dtype) + bridge.cfg.norm_weight_offset)
    return stack


def logit_attrs(
    bridge: Any,
    residual_stack: Float[Tensor, "component *batch_pos d_model"],
    tokens: int | Int[Tensor, "*batch_pos"],
    incorrect_tokens: int | Int[Tensor, "*batch_pos"] | None = None,
    *,
    dequantize: bool = False,
) -> Float[Tensor, " component *batch_pos"]:
    """Direct logit attribution: each component's dot product with ``W_U[:, tokens]`` (minus
    ``W_U[:, incorrect_tokens]`` when given). W_U is read through the guard."""
    w_u = accessors.W_U(bridge, dequantize=dequantize)
    direction = w_u.T[torch.as_tensor(tokens, device=w_u.device)]
    if incorrect_tokens is not None:
        direction = direction - w_u.T[torch.as_tensor(incorrect_tokens, device=w_u.device)]
    return (residual_stack * direction.to(residual_stack.dtype)).sum(-1)
