"""Residual-stream decompositions of a cached forward, and their direct logit attribution.

Components are stacked on a leading ``component`` dim with string labels; they sum to the
residual stream (``hook_resid_pre`` of ``layer``, or the final residual when ``layer=None``).
Weights (W_O, W_out, W_U) are read through the guarded accessors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.analysis.components import head_results, neuron_results
from qlens.analysis.labeled import Labeled
from qlens.analysis.slicing import Slice, SliceInput
from qlens.weights import accessors
from qlens.weights.access import read_optional


def _layer_count(bridge: Any, layer: int | None) -> int:
    n = bridge.cfg.n_layers
    if layer is None or layer == -1:
        return n
    if not 0 <= layer <= n:
        raise ValueError(
            f"layer must be in [0, {n}] (or None or -1 for the final residual), got {layer}"
        )
    return layer


def _branch(cache: Any, layer: int, kind: str) -> Tensor:
    """What the residual receives from a layer's attention or MLP (after any sandwich norm)."""
    post = "ln1_post" if kind == "attn" else "ln2_post"
    name = f"blocks.{layer}.{post}.hook_out"
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
    mlp_input: bool = False,
) -> Labeled:
    """The residual stream as embed, pos_embed and each layer's attention and MLP outputs.

    ``mode`` keeps ``"all"``, ``"attn"`` or ``"mlp"`` outputs. ``mlp_input`` decomposes the
    input of ``layer``'s MLP instead of its attention (adding that layer's attention output).
    Values are ``[component *batch pos d_model]``.
    """
    if mode not in ("all", "attn", "mlp"):
        raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
    n = _layer_count(bridge, layer)
    _check_mlp_input(bridge, n, mlp_input)
    parts, labels = _embeds(cache) if incl_embeds else ([], [])
    for i in range(n):
        for kind in ("attn", "mlp"):
            if mode in ("all", kind):
                parts.append(_branch(cache, i, kind))
                labels.append(f"{i}_{kind}_out")
    if mlp_input and mode != "mlp":
        parts.append(_branch(cache, n, "attn"))
        labels.append(f"{n}_attn_out")
    if not parts:
        raise ValueError(
            "nothing to decompose: no embeddings (incl_embeds=False) and no layer before "
            f"layer={layer} of the kind {mode!r}"
        )
    return _stack(parts, labels)


def _check_mlp_input(bridge: Any, layer: int, mlp_input: bool) -> None:
    if mlp_input and layer == bridge.cfg.n_layers:
        raise ValueError(
            "mlp_input=True needs a layer below n_layers: the final residual feeds the unembed, "
            "not an MLP"
        )


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
    bridge: Any,
    cache: Any,
    layer: int | None = None,
    *,
    apply_post_norm: bool = False,
    dequantize: bool = False,
) -> Labeled:
    """Each head's output ``z_h @ W_O[h]`` for the layers before ``layer`` (bias excluded).

    Values are ``[component *batch pos d_model]``, labels ``L{layer}H{head}``; needs
    ``attn.hook_z`` in the cache. With ``apply_post_norm`` on a sandwich-norm model (Gemma 2/3),
    each head goes through the attention post-norm linearly, with the norm's scale frozen from
    the cache (``ln1_post.hook_scale``): ``result_h * w_post / scale``, Gemma's ``1 + w`` (see
    :func:`apply_ln_to_stack`); these are the heads' terms of the residual stream. W_O is read
    through the guard (``dequantize`` opts in).
    """
    parts: list[Tensor] = []
    labels: list[str] = []
    for i in range(_layer_count(bridge, layer)):
        result = head_results(bridge, cache, i, dequantize=dequantize).movedim(-2, 0)
        if apply_post_norm and _has_sandwich_norms(bridge):
            result = _through_post_norm(bridge, cache, i, "attn", result)
        parts.extend(result.unbind(0))
        labels += [f"L{i}H{h}" for h in range(result.shape[0])]
    if not parts:
        raise ValueError("stack_head_results needs at least one layer (layer >= 1 or None)")
    return _stack(parts, labels)


def _post_norm(bridge: Any, cache: Any, layer: int, kind: str) -> tuple[Any, Tensor]:
    """The sandwich post-norm after a layer's attention or MLP, and its cached scale."""
    field = "ln1_post" if kind == "attn" else "ln2_post"
    name = f"blocks.{layer}.{field}.hook_scale"
    if name not in cache:
        raise ValueError(
            f"decomposing a {bridge.cfg.family} residual through its post-norms needs {name} "
            "in the cache; run run_with_cache without a names_filter that drops it"
        )
    return accessors.required_layer_module(bridge, layer, field), cache[name]


def _through_post_norm(bridge: Any, cache: Any, layer: int, kind: str, stack: Tensor) -> Tensor:
    norm, scale = _post_norm(bridge, cache, layer, kind)
    return _normalize_linearly(bridge, norm, scale, stack)


def _post_norm_bias(bridge: Any, cache: Any, layer: int, kind: str) -> Tensor | None:
    norm, _ = _post_norm(bridge, cache, layer, kind)
    return read_optional(norm, "bias", operation="decompose the residual through a post-norm")


def get_full_resid_decomposition(
    bridge: Any,
    cache: Any,
    layer: int | None = None,
    *,
    expand_neurons: bool = False,
    mlp_input: bool = False,
    dequantize: bool = False,
) -> Labeled:
    """The residual as every head, every MLP (or every neuron), the embeddings and the biases.

    Components: each head (``L{i}H{h}``), each MLP (``{i}_mlp_out``) or with
    ``expand_neurons`` each neuron (``L{i}N{n}``), the embeddings, and ``bias`` (the attention
    output biases, with ``expand_neurons`` the MLP output biases, and any post-norm biases).
    Sandwich-norm families (Gemma 2/3) normalize each attention/MLP output before adding it:
    there every term goes through that post-norm linearly, with the norm's scale frozen from the
    cache (``blocks.{i}.ln1_post.hook_scale`` / ``ln2_post.hook_scale``), so the components still
    sum to the residual exactly. ``mlp_input`` decomposes the input of ``layer``'s MLP instead
    of its attention (adding that layer's heads and attention bias).
    """
    n = _layer_count(bridge, layer)
    _check_mlp_input(bridge, n, mlp_input)
    n_attn = n + int(mlp_input)
    sandwich = _has_sandwich_norms(bridge)
    heads = (
        stack_head_results(bridge, cache, n_attn, apply_post_norm=True, dequantize=dequantize)
        if n_attn
        else None
    )
    parts = list(heads.values.unbind(0)) if heads is not None else []
    labels = list(heads.labels["component"]) if heads is not None else []
    bias = torch.zeros_like(cache["hook_embed"])
    for i in range(n_attn):
        attn_bias = accessors.b_O(bridge, i, dequantize=dequantize).to(bias.dtype)
        bias = bias + _post_normed_bias(bridge, cache, i, "attn", attn_bias, sandwich)
    for i in range(n):
        if not expand_neurons:
            parts.append(_branch(cache, i, "mlp"))
            labels.append(f"{i}_mlp_out")
            continue
        neurons = neuron_results(bridge, cache, i, dequantize=dequantize).movedim(-2, 0)
        if sandwich:
            neurons = _through_post_norm(bridge, cache, i, "mlp", neurons)
        parts.extend(neurons.unbind(0))
        labels += [f"L{i}N{j}" for j in range(neurons.shape[0])]
        mlp_bias = accessors.b_out(bridge, i, dequantize=dequantize).to(bias.dtype)
        bias = bias + _post_normed_bias(bridge, cache, i, "mlp", mlp_bias, sandwich)
    embeds, embed_labels = _embeds(cache)
    return _stack([*parts, *embeds, bias], [*labels, *embed_labels, "bias"])


def _post_normed_bias(
    bridge: Any, cache: Any, layer: int, kind: str, bias: Tensor, sandwich: bool
) -> Tensor:
    """A layer's output bias as it reaches the residual (through the post-norm, plus its bias)."""
    if not sandwich:
        return bias
    normed = _through_post_norm(bridge, cache, layer, kind, bias)  # [*batch pos d_model]
    norm_bias = _post_norm_bias(bridge, cache, layer, kind)
    return normed if norm_bias is None else normed + norm_bias.to(normed.dtype)


def _norm_for(bridge: Any, layer: int | None, mlp_input: bool) -> tuple[Any, str]:
    layer = _layer_count(bridge, layer)
    if layer == bridge.cfg.n_layers:
        _check_mlp_input(bridge, layer, mlp_input)
        return bridge.ln_final, "ln_final.hook_scale"
    field = "ln2" if mlp_input else "ln1"
    return accessors.layer_module(bridge, layer, field), f"blocks.{layer}.{field}.hook_scale"


def _normalize_linearly(
    bridge: Any, norm: Any, scale: Tensor, stack: Tensor, norm_weight: bool = True
) -> Tensor:
    """A norm applied to each component of ``stack`` with the full input's ``scale`` frozen:
    centered (LayerNorm), divided by ``scale``, times the weight (Gemma: ``1 + w``) unless
    ``norm_weight`` is False; no bias."""
    if bridge.cfg.normalization_type == "LN":
        stack = stack - stack.mean(-1, keepdim=True)
    stack = stack / scale.to(stack.dtype)
    if not norm_weight:
        return stack
    weight = read_optional(norm, "weight", operation="apply a norm to a residual stack")
    if weight is not None:
        stack = stack * (weight.to(stack.dtype) + bridge.cfg.norm_weight_offset)
    return stack


def apply_ln_to_stack(
    bridge: Any,
    cache: Any,
    residual_stack: Float[Tensor, "component *batch_pos d_model"],
    layer: int | None = None,
    *,
    mlp_input: bool = False,
    bias_component: int | None = None,
    norm_weight: bool = True,
    pos_slice: SliceInput = None,
    batch_slice: SliceInput = None,
) -> Float[Tensor, "component *batch_pos d_model"]:
    """Apply the norm in front of ``layer`` (final norm when None or -1) to each component
    linearly.

    Each component is centered (LayerNorm), divided by the cached ``hook_scale`` of the full
    residual and multiplied by the norm's weight (Gemma: ``1 + w``); ``norm_weight=False``
    leaves the weight out, as TransformerLens' ``apply_ln_to_stack`` does (identical once the
    norms are folded). ``pos_slice`` / ``batch_slice`` (TransformerLens ``Slice`` semantics)
    say which positions / batch rows of the cached scale the stack holds. The norm's bias belongs to
    no component: by default it is left out (as TransformerLens does), so the components sum to
    ``hook_out`` minus the bias. Pass ``bias_component`` (e.g. ``-1`` for the ``bias``
    component of :func:`get_full_resid_decomposition`, which holds the decomposition's constant
    terms the same way) to add it to that component; then the stack sums to ``hook_out``
    exactly. Folding the norms (``qlens.weights.process_weights``) removes the bias altogether.
    """
    norm, scale_name = _norm_for(bridge, layer, mlp_input)
    scale = cache[scale_name]
    if scale.ndim == 3:  # [batch pos 1]
        scale = Slice(batch_slice).apply(scale, 0)
    scale = Slice(pos_slice).apply(scale, -2)
    stack = _normalize_linearly(bridge, norm, scale, residual_stack, norm_weight)
    if bias_component is None:
        return stack
    if not -stack.shape[0] <= bias_component < stack.shape[0]:
        raise IndexError(
            f"bias_component {bias_component} is out of range for a stack of {stack.shape[0]} "
            "components"
        )
    bias = read_optional(norm, "bias", operation="apply a norm to a residual stack")
    if bias is None:
        return stack
    stack = stack.clone()
    stack[bias_component] = stack[bias_component] + bias.to(stack.dtype)
    return stack


def logit_attrs(
    bridge: Any,
    residual_stack: Float[Tensor, "component *batch_pos d_model"],
    tokens: int | Int[Tensor, "..."],
    incorrect_tokens: int | Int[Tensor, "..."] | None = None,
    *,
    dequantize: bool = False,
    allow_softcap: bool = False,
) -> Float[Tensor, "component ..."]:
    """Direct logit attribution: each component's dot product with ``W_U[:, tokens]`` (minus
    ``W_U[:, incorrect_tokens]`` when given). W_U is read through the guard.

    ``tokens`` broadcasts against the stack's ``*batch pos`` dims, with TransformerLens' rule
    for a ``[batch pos d_model]`` stack: a 1-D tensor as long as the batch gives one token per
    sequence (pass ``[1, pos]`` for one per position when batch and pos are equal).

    The attributions add up to the logits before any final softcapping. Models that softcap
    their logits (Gemma 2: ``logits = c * tanh(raw / c)``) make this approximate: the capped
    logit difference is not a sum of per-component terms, and each component's true effect
    depends on all the others. A warning says so unless ``allow_softcap=True``.
    """
    softcap = bridge.cfg.final_logit_softcapping
    if softcap and not allow_softcap:
        warnings.warn(
            f"this {bridge.cfg.family} model softcaps its final logits "
            f"(logits = {softcap} * tanh(raw / {softcap})), so direct logit attribution is "
            "approximate: the attributions add up to the raw logits before the softcap, not to "
            "the model's logits. Pass allow_softcap=True to accept this and silence the warning",
            UserWarning,
            stacklevel=2,
        )
    w_u = accessors.W_U(bridge, dequantize=dequantize)
    direction = w_u.T[torch.as_tensor(tokens, device=w_u.device)]
    if incorrect_tokens is not None:
        wrong = torch.as_tensor(incorrect_tokens, device=w_u.device)
        if wrong.shape != torch.as_tensor(tokens).shape:
            raise ValueError(
                f"tokens and incorrect_tokens must have the same shape, got "
                f"{tuple(torch.as_tensor(tokens).shape)} and {tuple(wrong.shape)}"
            )
        direction = direction - w_u.T[wrong]
    if residual_stack.ndim == 4 and direction.ndim == 2:
        if direction.shape[0] == residual_stack.shape[1]:  # one token per batch row
            direction = direction[:, None]
    return (residual_stack * direction.to(residual_stack.dtype)).sum(-1)
