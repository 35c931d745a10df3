"""Resolve an adapter's module paths on a concrete model into modules and hook sites."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import Tensor, nn

from qlens.bridge import taps
from qlens.bridge.adapters.base import Adapter
from qlens.bridge.config import BridgeConfig, resolve_flag
from qlens.bridge.names import MLP_IN_NAME, SHARED_EXPERT_NAMES, SPLIT_INPUT_NAMES, LayerLayout
from qlens.bridge.projection_taps import FusedQKSite, FusedQKV, ProjectionHeadsSite
from qlens.bridge.routing import route
from qlens.bridge.shared_expert_taps import SharedExpertSite
from qlens.bridge.split_inputs import FusedSplitInputSite, SplitInputSite


def get_module(root: nn.Module, path: str | None) -> nn.Module | None:
    """The submodule at a dotted path, or None when the path is None or absent."""
    if path is None:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def require_module(root: nn.Module, path: str, what: str) -> nn.Module:
    module = get_module(root, path)
    if module is None:
        raise ValueError(
            f"the adapter says the {what} is at {path!r}, but {type(root).__name__} has no such "
            "module; the model does not match its adapter table (qlens.bridge.adapters)"
        )
    return module


@dataclass
class ResolvedLayer:
    index: int
    layer: nn.Module
    modules: dict[str, nn.Module]  # LayerPaths field name -> module, only those present
    layout: LayerLayout


def resolve_layers(model: nn.Module, adapter: Adapter) -> list[ResolvedLayer]:
    layers = require_module(model, adapter.layers, "layer list")
    parallel = resolve_flag(model.config, adapter.parallel_attn_mlp)
    resolved = []
    for i, layer in enumerate(layers.children()):
        modules = {}
        for field_name, path in adapter.layer.__dict__.items():
            module = get_module(layer, path)
            if module is not None:
                modules[field_name] = module
        for required in ("ln1", "attn", "o", "ln2"):
            if required not in modules:
                require_module(layer, getattr(adapter.layer, required), f"layer {i} {required}")
        moe = "router" in modules
        if not moe and "mlp_down" not in modules:
            require_module(layer, adapter.layer.mlp_down or "<none>", f"layer {i} mlp_down")
        layout = LayerLayout(
            ln1_post="ln1_post" in modules,
            ln2_post="ln2_post" in modules,
            parallel=parallel,
            moe=moe,
            shared_expert=moe and "shared_mlp_down" in modules,
            gated="mlp_gate" in modules or "mlp_gate_up" in modules,
            rotary=adapter.positional_embedding_type == "rotary",
            split_inputs="qkv" in modules or all(name in modules for name in ("q", "k", "v")),
        )
        resolved.append(ResolvedLayer(i, layer, modules, layout))
    return resolved


def build_layer_sites(
    rl: ResolvedLayer,
    adapter: Adapter,
    cfg: BridgeConfig,
    store: dict[str, Tensor],
    owner: nn.Module,
) -> list[taps.Site]:
    """The hook sites of one layer, in the order their PyTorch hooks must run.

    ``owner`` is the wrapped model: weight reads made by a site are on its behalf.
    """
    m, p, rms = rl.modules, f"blocks.{rl.index}.", adapter.normalization_type == "RMS"
    offset = adapter.norm_weight_offset
    sites: list[taps.Site] = [
        taps.LayerInputSite(rl.layer, p + "hook_resid_pre", store),
        taps.NormSite(m["ln1"], p + "ln1", rms, offset),
        # before hook_q/hook_k's sites on the same projections: they see the per-head result
        *_split_input_sites(rl, adapter, cfg, store),
        *_pre_rotary_sites(rl, adapter, cfg),
        taps.ResultSite(m["o"], p + "attn.hook_result", cfg.n_heads, owner),
        taps.OutputSite(m["attn"], p + "hook_attn_out"),
    ]
    mid_branch = m["attn"]
    if "ln1_post" in m:
        sites.append(taps.NormSite(m["ln1_post"], p + "ln1_post", rms, offset))
        mid_branch = m["ln1_post"]
    if not rl.layout.parallel:
        sites.append(
            taps.ResidMidSite(mid_branch, p + "hook_resid_mid", store, p + "hook_resid_pre")
        )
    sites.append(taps.InputSite(m["ln2"], p + MLP_IN_NAME))
    sites.append(taps.NormSite(m["ln2"], p + "ln2", rms, offset))
    if rl.layout.moe:
        if adapter.router_scheme is None:
            raise ValueError(f"adapter {adapter.family!r} has a router but no router_scheme")
        renormalize = resolve_flag(_config_of(rl), adapter.router_renormalize)
        routing = partial(
            route,
            top_k=cfg.experts_per_token,
            scheme=adapter.router_scheme,
            renormalize=renormalize,
        )
        sites.append(
            taps.RouterSite(
                m["mlp"],
                m["router"],
                p + "mlp.hook_router_logits",
                p + "mlp.hook_router_weights",
                routing,
            )
        )
        if rl.layout.shared_expert:
            sites.append(_shared_expert_site(rl, adapter))
    elif "mlp_gate_up" in m:
        sites.append(
            taps.GateUpSite(m["mlp_gate_up"], p + "mlp.hook_pre", p + "mlp.hook_pre_linear")
        )
    elif "mlp_gate" in m:
        sites.append(taps.OutputSite(m["mlp_gate"], p + "mlp.hook_pre"))
        sites.append(taps.OutputSite(m["mlp_up"], p + "mlp.hook_pre_linear"))
    else:
        sites.append(taps.OutputSite(m["mlp_in"], p + "mlp.hook_pre"))
    if not rl.layout.moe:
        sites.append(taps.InputSite(m["mlp_down"], p + "mlp.hook_post"))
    sites.append(taps.OutputSite(m["mlp"] if "mlp" in m else m["mlp_down"], p + "hook_mlp_out"))
    if "ln2_post" in m:
        sites.append(taps.NormSite(m["ln2_post"], p + "ln2_post", rms, offset))
    sites.append(taps.OutputSite(rl.layer, p + "hook_resid_post"))
    # The layer input is recorded for resid_mid and, in families that flatten tokens, to give
    # the [batch pos] shape to sites that see [batch*pos ...] tensors.
    if not rl.layout.parallel:
        sites[0].also_needed_by = (p + "hook_resid_mid",)
    if rl.layout.split_inputs:
        sites[0].also_needed_by += tuple(p + n for n in SPLIT_INPUT_NAMES)
    if adapter.flattens_tokens:
        sites[0].also_needed_by = tuple(n for site in sites for n in site.names)

        def shape() -> tuple[int, ...]:
            return tuple(store[p + "hook_resid_pre"].shape[:-1])

        for site in sites[1:]:
            site.shape = shape
    return sites


def _pre_rotary_sites(rl: ResolvedLayer, adapter: Adapter, cfg: BridgeConfig) -> list[taps.Site]:
    """``attn.hook_q``/``hook_k`` of a rotary layer, on the projections' outputs."""
    if not rl.layout.rotary:
        return []
    m, q, k = rl.modules, f"blocks.{rl.index}.attn.hook_q", f"blocks.{rl.index}.attn.hook_k"
    if "q" in m and "k" in m:
        return [
            ProjectionHeadsSite(m["q"], q, cfg.d_head),
            ProjectionHeadsSite(m["k"], k, cfg.d_head),
        ]
    if "qkv" not in m:
        raise ValueError(
            f"adapter {adapter.family!r} names neither q/k projections nor a fused qkv, so "
            "attn.hook_q/hook_k have no site"
        )
    return [FusedQKSite(m["qkv"], q, k, _fused_qkv(adapter, cfg))]


def _split_input_sites(
    rl: ResolvedLayer, adapter: Adapter, cfg: BridgeConfig, store: dict[str, Tensor]
) -> list[taps.Site]:
    """The per-head q/k/v input hooks, on separate q/k/v projections or a fused qkv."""
    if not rl.layout.split_inputs:
        return []
    m, p = rl.modules, f"blocks.{rl.index}."
    q_in, k_in, v_in, attn_in = (p + n for n in SPLIT_INPUT_NAMES)
    names, resid_pre = (q_in, k_in, v_in, attn_in), p + "hook_resid_pre"
    if "qkv" in m:
        fused = _fused_qkv(adapter, cfg)
        return [FusedSplitInputSite(m["qkv"], fused, m["ln1"], names, resid_pre, store)]
    qkv = (m["q"], m["k"], m["v"])
    return [
        SplitInputSite(
            qkv, m["ln1"], names, resid_pre, store, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        )
    ]


def _fused_qkv(adapter: Adapter, cfg: BridgeConfig) -> FusedQKV:
    if adapter.qkv_layout is None:
        raise ValueError(
            f"adapter {adapter.family!r} names a fused qkv but no qkv_layout, so its q/k/v "
            "parts cannot be found; set qkv_layout in the adapter table"
        )
    return FusedQKV(adapter.qkv_layout, cfg.n_heads, cfg.n_kv_heads, cfg.d_head)


def _shared_expert_site(rl: ResolvedLayer, adapter: Adapter) -> SharedExpertSite:
    """``mlp.hook_routed_out`` / ``hook_shared_expert_out``; before ``hook_mlp_out``'s site on
    the same block, so that one sees the sum the block returns."""
    m = rl.modules
    missing = [name for name in ("mlp", "experts", "shared_expert_gate") if name not in m]
    if missing:
        raise ValueError(
            f"layer {rl.index} of this {adapter.family} model has a shared expert but no "
            f"{', '.join(missing)} module at the adapter's paths, so its output cannot be told "
            "apart from the routed experts'; the model does not match its adapter table "
            "(qlens.bridge.adapters)"
        )
    prefix = f"blocks.{rl.index}."
    routed, shared = (prefix + name for name in SHARED_EXPERT_NAMES)
    return SharedExpertSite(
        m["mlp"], m["experts"], m["shared_mlp_down"], m["shared_expert_gate"], routed, shared
    )


def _config_of(rl: ResolvedLayer) -> object:
    return rl.modules["attn"].config
