"""Rebuilding quantized experts as the family's float class: gate/up relayout and class lookup."""

from __future__ import annotations

import pytest
import torch
from arch_models import tiny_model

from qlens.weights.float_experts import _relayout, hf_experts_class


def test_relayout_between_stacked_halves_and_interleaved_rows():
    gate = torch.arange(6.0).reshape(1, 3, 2)  # [E=1, I=3, H=2]
    up = 100 + gate
    halves = torch.cat([gate, up], dim=-2)
    interleaved = _relayout(halves, "halves", "interleaved", dim=-2)
    expected = torch.stack([gate[0, 0], up[0, 0], gate[0, 1], up[0, 1], gate[0, 2], up[0, 2]])
    assert torch.equal(interleaved, expected[None])
    assert torch.equal(_relayout(interleaved, "interleaved", "halves", dim=-2), halves)
    bias = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0, 30.0]])  # [E=1, 2I] as [gate; up]
    assert _relayout(bias, "halves", "interleaved", dim=-1).tolist() == [
        [1.0, 10.0, 2.0, 20.0, 3.0, 30.0]
    ]
    assert _relayout(bias, "halves", "halves", dim=-1) is bias


def test_the_float_experts_class_is_found_next_to_the_moe_block():
    model = tiny_model("qwen3_moe")
    block = model.model.layers[0].mlp
    assert hf_experts_class(model, block) is type(block.experts)
    dense = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="cannot find the float experts class of Llama"):
        hf_experts_class(dense, dense.model.layers[0].mlp)
