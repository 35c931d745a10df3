"""HTML summaries of a Bridge, an ActivationCache and a QuantPayload carry the key facts."""

from __future__ import annotations

import torch

from qlens.modules.model_quantize import quantize
from qlens.quant.quantize import quantize_weight
from qlens.viz import render_bridge_html, render_cache_html, render_payload_html


def test_bridge_html_has_family_size_quantization_and_hooks(tiny_bridge):
    html = render_bridge_html(tiny_bridge)
    assert "LlamaForCausalLM" in html and "llama" in html
    assert "<th style='text-align:left'>layers</th><td>2</td>" in html
    assert f"<td>{len(tiny_bridge.hook_names)}</td>" in html
    assert "none (all weights are readable floats)" in html
    n_params = sum(p.numel() for p in tiny_bridge.model.parameters())
    assert f"{n_params:,}" in html


def test_quantized_bridge_html_counts_modules_by_format(tiny_bridge):
    quantized = quantize(tiny_bridge, "int8", group_size=32)
    html = render_bridge_html(quantized)
    assert "14 × qlens int8" in html  # 2 layers x (q, k, v, o, gate, up, down)


def test_cache_html_lists_names_shapes_and_bytes(tiny_run):
    _, cache, _ = tiny_run
    html = render_cache_html(cache)
    assert f"{len(cache)} tensors" in html
    assert (
        "<td><code>blocks.1.attn.hook_pattern</code></td><td>(1, 4, 7, 7)</td><td>float32</td>"
        in html
    )
    assert f"<td>{1 * 4 * 7 * 7 * 4} B</td>" in html
    assert "overflow-y:auto" in html  # more than 30 names scroll


def test_payload_html_has_format_shape_bits_and_bytes():
    payload = quantize_weight(torch.randn(64, 96), "mxfp4")
    html = render_payload_html(payload)
    assert "<code>mxfp4</code>" in html
    assert "[64, 96]" in html
    assert f"{payload.bits_per_weight:.2f}" in html and payload.bits_per_weight == 4.25
    assert f"{payload.nbytes:,} B" in html
    assert "e8m0 per block (1, 32)" in html
