"""Quantize-on-load holds one layer's float weights at a time: each is freed once quantized."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from tiny_models import make_model

import qlens
from qlens.modules import model_quantize


def test_each_float_layer_is_freed_as_soon_as_it_is_quantized(tmp_path: Path, monkeypatch):
    make_model("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    quantize_layer = model_quantize.quantized_module
    earlier: list[weakref.ref] = []
    alive_at_each_layer: list[int] = []

    def watched(plan, scheme, options):
        alive_at_each_layer.append(sum(ref() is not None for ref in earlier))
        earlier.append(weakref.ref(plan.module.weight))
        return quantize_layer(plan, scheme, options)

    monkeypatch.setattr(model_quantize, "quantized_module", watched)
    bridge = qlens.load(tmp_path, quantize="int4")
    assert len(alive_at_each_layer) > 7  # every linear of the decoder layers
    assert alive_at_each_layer == [0] * len(alive_at_each_layer)
    assert all(ref() is None for ref in earlier)
    assert not any(
        p.dtype.is_floating_point and p.dim() == 2 and ".layers." in name and "norm" not in name
        for name, p in bridge.model.named_parameters()
    )
    assert isinstance(bridge.model.model.layers[0].mlp.down_proj.payload.data, torch.Tensor)
