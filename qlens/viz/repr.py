"""HTML summaries for notebooks: a Bridge, an ActivationCache and a QuantPayload."""

from __future__ import annotations

import html
from collections import Counter
from typing import Any

from qlens.formatting import format_bytes
from qlens.modules.payload_buffers import PayloadModule
from qlens.quant.guards import quantization_method
from qlens.quant.payload import QuantPayload
from qlens.weights import unreadable_weights

# Caches longer than this render their table inside a scrolling box.
_SCROLL_ROWS = 30


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def quantized_weights(model: Any) -> Counter[str]:
    """How many weights the guard refuses, by kind: the payload format of qlens modules, else
    the class of the library-quantized module (or the unreadable tensor's holder)."""
    kinds: Counter[str] = Counter()
    for item in unreadable_weights(model):
        if isinstance(item.module, PayloadModule):
            for spec in item.module.payload_specs().values():
                kinds[f"qlens {spec.format.name}"] += 1
        else:
            kinds[type(item.module).__name__] += 1
    return kinds


def render_bridge_html(bridge: Any) -> str:
    """Model family and size, quantization summary and hook count of a Bridge."""
    cfg, model = bridge.cfg, bridge.model
    n_params = sum(p.numel() for p in model.parameters())
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    kinds = quantized_weights(model)
    method = quantization_method(getattr(model, "config", None))
    if kinds:
        quant = ", ".join(f"{n} × {html.escape(k)}" for k, n in sorted(kinds.items())) + " weights"
    else:
        quant = "none (all weights are readable floats)"
    if method:
        quant = f"{html.escape(method)} checkpoint; " + quant
    heads = (
        f"{cfg.n_heads} ({cfg.n_kv_heads} key/value)"
        if cfg.n_kv_heads != cfg.n_heads
        else str(cfg.n_heads)
    )
    rows = [
        ("model", f"<code>{html.escape(type(model).__name__)}</code>"),
        ("family", html.escape(cfg.family)),
        ("layers", str(cfg.n_layers)),
        ("d_model / d_mlp / d_head", f"{cfg.d_model} / {cfg.d_mlp} / {cfg.d_head}"),
        ("heads", heads),
        ("vocabulary", str(cfg.d_vocab)),
        ("parameters", f"{n_params:,} ({format_bytes(n_bytes)} of weights and buffers)"),
        ("quantization", quant),
        ("hook points", str(len(bridge.hook_names))),
    ]
    return f"<div><b>qlens Bridge</b>{_table(rows)}</div>"


def render_cache_html(cache: Any) -> str:
    """Every cached name with its shape, dtype and size, and the total size."""
    rows = "".join(
        f"<tr><td><code>{html.escape(name)}</code></td><td>{tuple(value.shape)}</td>"
        f"<td>{_dtype(value.dtype)}</td><td>{format_bytes(value.numel() * value.element_size())}</td></tr>"
        for name, value in cache.items()
    )
    total = sum(v.numel() * v.element_size() for v in cache.values())
    table = f"<table><tr><th>name</th><th>shape</th><th>dtype</th><th>bytes</th></tr>{rows}</table>"
    if len(cache) > _SCROLL_ROWS:
        table = f"<div style='max-height:24em;overflow-y:auto'>{table}</div>"
    return f"<div><b>ActivationCache</b>: {len(cache)} tensors, {format_bytes(total)}{table}</div>"


def render_payload_html(payload: QuantPayload) -> str:
    """Format, logical shape, bits per weight, bytes and the tensors of a QuantPayload."""
    fmt = payload.format
    tensors = "<br>".join(
        f"<code>{html.escape(name)}</code>: {_dtype(t.dtype)} {list(t.shape)}"
        for name, t in payload.tensors().items()
    )
    rows = [
        ("format", f"<code>{html.escape(fmt.name)}</code> — {html.escape(fmt.description)}"),
        ("shape", str(list(payload.shape))),
        ("element", f"{html.escape(fmt.element)} ({fmt.bits} bits)"),
        ("scales", f"{html.escape(fmt.scale_dtype)} per block {tuple(fmt.block)}"),
        ("bits/weight", f"{payload.bits_per_weight:.2f} (scales included)"),
        ("bytes", f"{format_bytes(payload.nbytes)} ({payload.nbytes:,} B)"),
        ("tensors", tensors),
        ("device", html.escape(str(payload.device))),
    ]
    if payload.layout:
        rows.append(("layout", html.escape(str(payload.layout))))
    return f"<div><b>QuantPayload</b>{_table(rows)}</div>"
