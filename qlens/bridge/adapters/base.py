"""The adapter table format: where each canonical component lives inside an HF causal LM.

Every path is a dotted module path (``model.get_submodule(path)``); per-layer paths are relative
to the layer module. ``None`` means the family has no such component. To support a new family,
write one ``Adapter(...)`` table in a module of ``qlens.bridge.adapters`` and list it in
``qlens.bridge.adapters.ADAPTERS`` under its HF ``config.model_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

NormType = Literal["LN", "RMS"]
PositionalType = Literal["standard", "rotary"]
# Fused qkv output layouts: "qkv_blocks" = [all q | all k | all v] along the output dim;
# "per_head_qkv" = for each head [q | k | v] (GPT-NeoX).
QKVLayout = Literal["qkv_blocks", "per_head_qkv"]
# Fused gate/up layouts: "halves" = [gate | up]; "interleaved" = gate at even, up at odd indices.
GateUpLayout = Literal["halves", "interleaved"]
# MoE routing: "softmax_topk" = softmax over all experts, then top-k (optionally renormalized);
# "topk_softmax" = top-k of the logits, then softmax over the k selected logits.
RouterScheme = Literal["softmax_topk", "topk_softmax"]


@dataclass(frozen=True)
class LayerPaths:
    """Module paths relative to one decoder layer."""

    ln1: str
    attn: str
    o: str  # output projection, relative to the layer
    ln2: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None  # fused projection, see Adapter.qkv_layout
    q_norm: str | None = None
    k_norm: str | None = None
    ln1_post: str | None = None  # sandwich norm applied to the attention output
    ln2_post: str | None = None  # sandwich norm applied to the MLP output
    mlp: str | None = None  # module whose output is the MLP output; None: use mlp_down
    mlp_in: str | None = None  # non-gated input projection
    mlp_gate: str | None = None
    mlp_up: str | None = None
    mlp_gate_up: str | None = None  # fused gate/up projection, see Adapter.gate_up_layout
    mlp_down: str | None = None
    router: str | None = None  # MoE router returning (logits, top-k weights, top-k indices)
    experts: str | None = None  # MoE experts holding fused 3-D gate_up_proj / down_proj
    # A gated MLP every token goes through beside the routed experts (Qwen2-MoE), its output
    # scaled by sigmoid(shared_expert_gate(x)) and added to theirs.
    shared_mlp_gate: str | None = None
    shared_mlp_up: str | None = None
    shared_mlp_down: str | None = None
    shared_expert_gate: str | None = None  # Linear(d_model, 1)


@dataclass(frozen=True)
class Adapter:
    """A declarative description of one model family.

    Facts that depend on the HF config may be given as a config attribute name (``str``) or a
    callable of the config; ``config_attrs`` overrides how ``BridgeConfig`` fields are read.
    """

    family: str
    embed: str
    layers: str
    ln_final: str
    unembed: str
    layer: LayerPaths
    normalization_type: NormType
    positional_embedding_type: PositionalType
    pos_embed: str | None = None
    gated_mlp: bool = True
    norm_weight_offset: float = 0.0  # Gemma RMSNorm multiplies by (1 + weight)
    parallel_attn_mlp: bool | str = False
    conv1d: bool = False  # GPT-2 Conv1D: weights stored [in, out]
    flattens_tokens: bool = False  # the layer reshapes [batch pos d] to [batch*pos d] (OPT MLP)
    qkv_layout: QKVLayout | None = None
    gate_up_layout: GateUpLayout | None = None
    experts_gate_up_layout: GateUpLayout | None = None
    experts_weights_in_out: bool = False  # experts stored [E, in, out] instead of [E, out, in]
    router_scheme: RouterScheme | None = None
    router_renormalize: bool | str = True
    act_fn: str | None = None  # fixed activation name; None reads it from the config
    # whether strings get a BOS token by default (TransformerLens' per-family default)
    default_prepend_bos: bool = True
    config_attrs: dict[str, str | Callable[[Any], Any]] = field(default_factory=dict)
    check_config: Callable[[Any], None] | None = None  # raises on unsupported variants
