"""TransformerLens-shaped weight accessors on a Bridge, all read through ``qlens.weights.access``.

Per layer (``layer=i``) or stacked over layers (``layer=None``, leading ``layer`` dim). Fused
projections are split (Phi-3 qkv and gate_up, GPT-NeoX per-head qkv, GPT-2's Conv1D), grouped K/V
come as stored (``kv_head``) or repeated per query head (``repeat_kv=True``). Pass
``dequantize=True`` (or read inside ``with qlens.weights.dequantized(bridge):``) to rebuild
quantized weights in float instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from qlens.weights.access import (
    ExpertWeights,
    GateUpLayout,
    read_experts,
    read_optional,
    read_weight,
    split_gate_up,
)


def required_layer_module(bridge: Any, layer: int, component: str) -> nn.Module:
    """Like :func:`layer_module`, for components every layer of a supported model has."""
    module = layer_module(bridge, layer, component)
    if module is None:
        raise ValueError(
            f"layer {layer} of this {bridge.adapter.family} model has no {component!r} module; "
            "the adapter table does not match the model"
        )
    return module


def layer_module(bridge: Any, layer: int, component: str) -> nn.Module | None:
    """The module of ``component`` (a ``LayerPaths`` field such as ``"q"``) in ``layer``."""
    n = bridge.cfg.n_layers
    if not -n <= layer < n:
        raise IndexError(f"layer {layer} is out of range for a model with {n} layers")
    path = getattr(bridge.adapter.layer, component)
    if path is None:
        return None
    layers = bridge.model.get_submodule(bridge.adapter.layers)
    try:
        return layers[layer].get_submodule(path)
    except AttributeError:
        return None


def _require(bridge: Any, layer: int, component: str) -> nn.Module:
    module = layer_module(bridge, layer, component)
    if module is None:
        raise ValueError(
            f"layer {layer} of this {bridge.cfg.family} model has no {component!r} module "
            f"(adapter path {getattr(bridge.adapter.layer, component)!r})"
        )
    return module


def _stacked(bridge: Any, layer: int | None, per_layer: Callable[[int], Tensor]) -> Tensor:
    if layer is not None:
        return per_layer(layer)
    return torch.stack([per_layer(i) for i in range(bridge.cfg.n_layers)])


# -- embeddings and unembedding -------------------------------------------------------------
def W_E(bridge: Any, *, dequantize: bool = False) -> Float[Tensor, "d_vocab d_model"]:
    """Token embedding matrix (as stored; Gemma's sqrt(d_model) scaling is not applied)."""
    return read_weight(
        bridge.embed, operation="read W_E (token embedding)", owner=bridge, dequantize=dequantize
    )


def W_pos(bridge: Any, *, dequantize: bool = False) -> Float[Tensor, "n_ctx d_model"]:
    """Learned position embeddings (OPT's offset rows are dropped); rotary models have none."""
    if bridge.pos_embed is None:
        raise ValueError(
            f"this {bridge.cfg.family} model has no learned position embedding "
            f"({bridge.cfg.positional_embedding_type} positions), so there is no W_pos"
        )
    weight = read_weight(
        bridge.pos_embed, operation="read W_pos (position embedding)", owner=bridge,
        dequantize=dequantize,
    )  # fmt: skip
    return weight[int(getattr(bridge.pos_embed, "offset", 0)) :]


def W_U(bridge: Any, *, dequantize: bool = False) -> Float[Tensor, "d_model d_vocab"]:
    """Unembedding matrix."""
    return read_weight(
        bridge.unembed, operation="read W_U (unembedding)", owner=bridge, dequantize=dequantize
    ).T


def b_U(bridge: Any, *, dequantize: bool = False) -> Float[Tensor, " d_vocab"]:
    """Unembedding bias (zeros when the model has none)."""
    bias = read_optional(
        bridge.unembed, "bias", operation="read b_U", owner=bridge, dequantize=dequantize
    )
    return bias if bias is not None else _zeros(W_U(bridge, dequantize=dequantize)[0])


def _zeros(like: Tensor) -> Tensor:
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device)


# -- attention ----------------------------------------------------------------------------------
def _qkv_rows(
    bridge: Any, layer: int, which: str, dequantize: bool
) -> tuple[Tensor, Tensor | None]:
    """The ``[heads*d_head, d_model]`` rows of q, k or v (and the bias), split from a fused qkv."""
    op = f"read W_{which.upper()} of layer {layer}"
    own = layer_module(bridge, layer, which)
    if own is not None:
        weight = read_weight(own, operation=op, owner=bridge, dequantize=dequantize)
        bias = read_optional(own, "bias", operation=op, owner=bridge, dequantize=dequantize)
        return weight, bias
    fused = _require(bridge, layer, "qkv")
    weight = read_weight(fused, operation=op + " (fused qkv)", owner=bridge, dequantize=dequantize)
    bias = read_optional(fused, "bias", operation=op, owner=bridge, dequantize=dequantize)
    rows = qkv_row_indices(bridge, which, weight.shape[0], layer)
    return weight[rows], None if bias is None else bias[rows]


def qkv_row_indices(
    bridge: Any, which: str, n_rows: int, layer: int | None = None
) -> Int[Tensor, " rows"]:
    """Indices of the q, k or v output rows inside the model's fused qkv projection."""
    cfg = bridge.cfg
    index = "qkv".index(which)
    if bridge.adapter.qkv_layout == "per_head_qkv":
        per_head = torch.arange(n_rows).reshape(cfg.n_heads, 3, -1)
        return per_head[:, index].reshape(-1)
    sizes = [cfg.n_heads * cfg.d_head] + [cfg.n_kv_heads * cfg.d_head] * 2
    if n_rows != sum(sizes):
        raise ValueError(
            f"fused qkv of layer {layer} has {n_rows} output rows, expected "
            f"{' + '.join(map(str, sizes))} (n_heads, n_kv_heads, d_head from the config)"
        )
    return torch.arange(n_rows).split(sizes)[index]


def _heads_in(rows: Tensor, n_heads: int) -> Tensor:
    """``[heads*d_head, d_model]`` -> ``[head d_model d_head]``."""
    return rows.reshape(n_heads, -1, rows.shape[-1]).transpose(1, 2)


def _repeat(t: Tensor, bridge: Any, repeat_kv: bool) -> Tensor:
    groups = bridge.cfg.n_heads // bridge.cfg.n_kv_heads
    return t.repeat_interleave(groups, dim=0) if repeat_kv and groups > 1 else t


def W_Q(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer head d_model d_head"]:
    """Query weights ``[head d_model d_head]`` (``[layer head d_model d_head]`` when stacked)."""
    return _stacked(
        bridge,
        layer,
        lambda i: _heads_in(_qkv_rows(bridge, i, "q", dequantize)[0], bridge.cfg.n_heads),
    )


def W_K(
    bridge: Any, layer: int | None = None, *, repeat_kv: bool = False, dequantize: bool = False
) -> Float[Tensor, "*layer head d_model d_head"]:
    """Key weights per stored kv head, or repeated per query head with ``repeat_kv=True``."""

    def one(i: int) -> Tensor:
        heads = _heads_in(_qkv_rows(bridge, i, "k", dequantize)[0], bridge.cfg.n_kv_heads)
        return _repeat(heads, bridge, repeat_kv)

    return _stacked(bridge, layer, one)


def W_V(
    bridge: Any, layer: int | None = None, *, repeat_kv: bool = False, dequantize: bool = False
) -> Float[Tensor, "*layer head d_model d_head"]:
    """Value weights per stored kv head, or repeated per query head with ``repeat_kv=True``."""

    def one(i: int) -> Tensor:
        heads = _heads_in(_qkv_rows(bridge, i, "v", dequantize)[0], bridge.cfg.n_kv_heads)
        return _repeat(heads, bridge, repeat_kv)

    return _stacked(bridge, layer, one)


def _head_bias(bridge: Any, layer: int, which: str, dequantize: bool, repeat_kv: bool) -> Tensor:
    cfg = bridge.cfg
    n = cfg.n_heads if which == "q" else cfg.n_kv_heads
    weight, bias = _qkv_rows(bridge, layer, which, dequantize)
    bias = bias if bias is not None else _zeros(weight[:, 0])
    heads = bias.reshape(n, -1)
    return heads if which == "q" else _repeat(heads, bridge, repeat_kv)


def b_Q(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer head d_head"]:
    """Query bias per head (zeros when absent)."""
    return _stacked(bridge, layer, lambda i: _head_bias(bridge, i, "q", dequantize, False))


def b_K(
    bridge: Any, layer: int | None = None, *, repeat_kv: bool = False, dequantize: bool = False
) -> Float[Tensor, "*layer head d_head"]:
    """Key bias per kv head (or per query head with ``repeat_kv``)."""
    return _stacked(bridge, layer, lambda i: _head_bias(bridge, i, "k", dequantize, repeat_kv))


def b_V(
    bridge: Any, layer: int | None = None, *, repeat_kv: bool = False, dequantize: bool = False
) -> Float[Tensor, "*layer head d_head"]:
    """Value bias per kv head (or per query head with ``repeat_kv``)."""
    return _stacked(bridge, layer, lambda i: _head_bias(bridge, i, "v", dequantize, repeat_kv))


def W_O(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer head d_head d_model"]:
    """Output weights ``[head d_head d_model]``."""

    def one(i: int) -> Tensor:
        weight = read_weight(
            _require(bridge, i, "o"), operation=f"read W_O of layer {i}", owner=bridge,
            dequantize=dequantize,
        )  # fmt: skip
        return weight.T.reshape(bridge.cfg.n_heads, -1, weight.shape[0])

    return _stacked(bridge, layer, one)


def b_O(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer d_model"]:
    """Attention output bias (zeros when absent)."""

    def one(i: int) -> Tensor:
        o = _require(bridge, i, "o")
        op = f"read b_O of layer {i}"
        bias = read_optional(o, "bias", operation=op, owner=bridge, dequantize=dequantize)
        if bias is not None:
            return bias
        return _zeros(read_weight(o, operation=op, owner=bridge, dequantize=dequantize)[:, 0])

    return _stacked(bridge, layer, one)


# -- MLP --------------------------------------------------------------------------------------
def _is_moe_layer(bridge: Any, layer: int) -> bool:
    return layer_module(bridge, layer, "experts") is not None


def _dense_rows(
    bridge: Any, layer: int, part: str, dequantize: bool
) -> tuple[Tensor, Tensor | None]:
    """``[d_mlp d_model]`` rows (and bias) of the gate or in (up) projection of a dense MLP."""
    op = f"read W_{part} of layer {layer}"
    if _is_moe_layer(bridge, layer):
        raise ValueError(
            f"layer {layer} is a mixture-of-experts layer: pass expert=<index> (or read all "
            "experts with qlens.weights.experts)"
        )
    fused = layer_module(bridge, layer, "mlp_gate_up")
    if fused is not None:
        weight = read_weight(
            fused, operation=op + " (fused gate_up)", owner=bridge, dequantize=dequantize
        )
        bias = read_optional(fused, "bias", operation=op, owner=bridge, dequantize=dequantize)
        layout = cast(GateUpLayout, bridge.adapter.gate_up_layout or "halves")
        index = 0 if part == "gate" else 1
        return (
            split_gate_up(weight, layout, dim=0)[index],
            None if bias is None else split_gate_up(bias, layout, dim=0)[index],
        )
    component = {"gate": "mlp_gate", "in": "mlp_up" if bridge.cfg.gated_mlp else "mlp_in"}[part]
    if part == "gate" and not bridge.cfg.gated_mlp:
        raise ValueError(f"this {bridge.cfg.family} model has no gated MLP, so there is no W_gate")
    module = _require(bridge, layer, component)
    weight = read_weight(module, operation=op, owner=bridge, dequantize=dequantize)
    return weight, read_optional(module, "bias", operation=op, owner=bridge, dequantize=dequantize)


def experts(bridge: Any, layer: int, *, dequantize: bool = False) -> ExpertWeights:
    """All experts' fused weights of an MoE layer, logical ``[experts, out, in]``."""
    module = _require(bridge, layer, "experts")
    return read_experts(
        module,
        operation=f"read the experts of layer {layer}",
        owner=bridge,
        dequantize=dequantize,
        layout=bridge.adapter.experts_gate_up_layout or "halves",
        stored_in_out=bridge.adapter.experts_weights_in_out,
    )


def _has_shared_expert(bridge: Any, layer: int) -> bool:
    return layer_module(bridge, layer, "shared_mlp_down") is not None


def _shared_expert_part(
    bridge: Any, layer: int, part: str, dequantize: bool
) -> tuple[Tensor, Tensor | None]:
    """The shared expert's weights ``[d_model d_shared]`` (``[d_shared d_model]`` for "out")."""
    if not _has_shared_expert(bridge, layer):
        raise ValueError(
            f"layer {layer} of this {bridge.cfg.family} model has no shared expert; "
            "expert='shared' applies to the MoE layers of families with one (Qwen2-MoE)"
        )
    component = {"gate": "shared_mlp_gate", "in": "shared_mlp_up", "out": "shared_mlp_down"}[part]
    module = _require(bridge, layer, component)
    op = f"read W_{part} of the shared expert of layer {layer}"
    weight = read_weight(module, operation=op, owner=bridge, dequantize=dequantize)
    return weight.T, read_optional(
        module, "bias", operation=op, owner=bridge, dequantize=dequantize
    )


def _expert_part(
    bridge: Any, layer: int, expert: int | Literal["shared"] | None, part: str, dequantize: bool
) -> tuple[Tensor, Tensor | None]:
    """TransformerLens-oriented expert weights ``[(expert) d_model d_mlp]`` and bias."""
    if expert == "shared":
        return _shared_expert_part(bridge, layer, part, dequantize)
    if expert is None and _has_shared_expert(bridge, layer):
        raise ValueError(
            f"layer {layer} is a mixture-of-experts layer with a shared expert "
            "(mlp.shared_expert, scaled by sigmoid(mlp.shared_expert_gate(x))) that a stack of "
            "the routed experts would leave out: pass expert=<index> for a routed expert, "
            "expert='shared' for the shared expert, and read its gate with W_shared_expert_gate"
        )
    weights = experts(bridge, layer, dequantize=dequantize)
    if part == "out":
        w, b = weights.down.transpose(-1, -2), weights.down_bias
    else:
        index = 0 if part == "gate" else 1
        w = weights.split_gate_up()[index].transpose(-1, -2)
        b = None
        if weights.gate_up_bias is not None:
            b = split_gate_up(weights.gate_up_bias, weights.layout, dim=-1)[index]
    if expert is None:
        return w, b
    n = w.shape[0]
    if not -n <= expert < n:
        raise IndexError(f"expert {expert} is out of range for a layer with {n} experts")
    return w[expert], None if b is None else b[expert]


def W_in(
    bridge: Any,
    layer: int | None = None,
    *,
    expert: int | Literal["shared"] | None = None,
    dequantize: bool = False,
) -> Float[Tensor, "*batch d_model d_mlp"]:
    """MLP input weights (the up projection of a gated MLP) ``[d_model d_mlp]``.

    MoE layers give ``[expert d_model d_mlp]``, or one expert's with ``expert=``; for MoE layers
    with a shared expert (Qwen2-MoE) ``expert=`` is required, ``expert="shared"`` gives the
    shared expert's ``[d_model d_shared]``.
    """
    return _stacked(bridge, layer, lambda i: _mlp_in(bridge, i, "in", expert, dequantize)[0])


def W_gate(
    bridge: Any,
    layer: int | None = None,
    *,
    expert: int | Literal["shared"] | None = None,
    dequantize: bool = False,
) -> Float[Tensor, "*batch d_model d_mlp"]:
    """Gate weights of a gated MLP ``[d_model d_mlp]`` (MoE layers as in :func:`W_in`)."""
    return _stacked(bridge, layer, lambda i: _mlp_in(bridge, i, "gate", expert, dequantize)[0])


def _mlp_in(
    bridge: Any, layer: int, part: str, expert: int | Literal["shared"] | None, dequantize: bool
) -> tuple[Tensor, Tensor | None]:
    if _is_moe_layer(bridge, layer):
        return _expert_part(bridge, layer, expert, part, dequantize)
    if expert is not None:
        raise ValueError(f"layer {layer} is a dense MLP layer; expert= applies to MoE layers only")
    rows, bias = _dense_rows(bridge, layer, part, dequantize)
    return rows.T, bias


def b_in(
    bridge: Any,
    layer: int | None = None,
    *,
    expert: int | Literal["shared"] | None = None,
    dequantize: bool = False,
) -> Float[Tensor, "*batch d_mlp"]:
    """MLP input (up) bias (zeros when absent)."""
    return _stacked(
        bridge, layer, lambda i: _bias_or_zeros(*_mlp_in(bridge, i, "in", expert, dequantize))
    )


def b_gate(
    bridge: Any,
    layer: int | None = None,
    *,
    expert: int | Literal["shared"] | None = None,
    dequantize: bool = False,
) -> Float[Tensor, "*batch d_mlp"]:
    """Gate bias of a gated MLP (zeros when absent)."""
    return _stacked(
        bridge, layer, lambda i: _bias_or_zeros(*_mlp_in(bridge, i, "gate", expert, dequantize))
    )


def W_out(
    bridge: Any,
    layer: int | None = None,
    *,
    expert: int | Literal["shared"] | None = None,
    dequantize: bool = False,
) -> Float[Tensor, "*batch d_mlp d_model"]:
    """MLP output weights ``[d_mlp d_model]`` (MoE layers as in :func:`W_in`)."""
    return _stacked(bridge, layer, lambda i: _mlp_out(bridge, i, expert, dequantize)[0])


def b_out(
    bridge: Any,
    layer: int | None = None,
    *,
    expert: int | Literal["shared"] | None = None,
    dequantize: bool = False,
) -> Float[Tensor, "*batch d_model"]:
    """MLP output bias (zeros when absent)."""
    return _stacked(
        bridge, layer, lambda i: _bias_or_zeros(*_mlp_out(bridge, i, expert, dequantize))
    )


def _bias_or_zeros(weight: Tensor, bias: Tensor | None) -> Tensor:
    """``bias``, or zeros over ``weight``'s last dimension when there is none."""
    return bias if bias is not None else _zeros(weight[..., 0, :])


def _mlp_out(
    bridge: Any, layer: int, expert: int | Literal["shared"] | None, dequantize: bool
) -> tuple[Tensor, Tensor | None]:
    if _is_moe_layer(bridge, layer):
        return _expert_part(bridge, layer, expert, "out", dequantize)
    if expert is not None:
        raise ValueError(f"layer {layer} is a dense MLP layer; expert= applies to MoE layers only")
    module = _require(bridge, layer, "mlp_down")
    op = f"read W_out of layer {layer}"
    weight = read_weight(module, operation=op, owner=bridge, dequantize=dequantize)
    bias = read_optional(module, "bias", operation=op, owner=bridge, dequantize=dequantize)
    return weight.T, bias


def W_shared_expert_gate(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer d_model"]:
    """The shared expert's gate ``[d_model]``: its output is scaled by ``sigmoid(x @ gate)``."""

    def one(i: int) -> Tensor:
        gate = _require(bridge, i, "shared_expert_gate")
        op = f"read the shared expert gate of layer {i}"
        return read_weight(gate, operation=op, owner=bridge, dequantize=dequantize)[0]

    return _stacked(bridge, layer, one)


def W_router(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer d_model n_experts"]:
    """MoE router weights ``[d_model n_experts]``."""

    def one(i: int) -> Tensor:
        router = _require(bridge, i, "router")
        return read_weight(
            router, operation=f"read the router of layer {i}", owner=bridge, dequantize=dequantize
        ).T

    return _stacked(bridge, layer, one)


def b_router(
    bridge: Any, layer: int | None = None, *, dequantize: bool = False
) -> Float[Tensor, "*layer n_experts"]:
    """MoE router bias (zeros when absent)."""

    def one(i: int) -> Tensor:
        router = _require(bridge, i, "router")
        op = f"read the router bias of layer {i}"
        bias = read_optional(router, "bias", operation=op, owner=bridge, dequantize=dequantize)
        return bias if bias is not None else _zeros(W_router(bridge, i, dequantize=dequantize)[0])

    return _stacked(bridge, layer, one)
