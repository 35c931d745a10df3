"""hook_result on a quantized o_proj: refused by default, exact under the explicit opt-in."""

from __future__ import annotations

import pytest
import torch
from bridge_models import tiny_model

import qlens
from qlens.bridge import Bridge
from qlens.modules.model_quantize import quantize

TOKENS = torch.tensor([[5, 17, 301, 42, 9, 77]])


def test_hook_result_on_quantized_model_needs_opt_in_then_matches_attn_out() -> None:
    torch.manual_seed(0)
    bridge = quantize(Bridge(tiny_model("llama")), "int8", group_size=32)
    names = ["blocks.0.attn.hook_result", "blocks.0.hook_attn_out"]
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match=r"hook_result.*quantization"):
            bridge.run_with_cache(TOKENS, names_filter=names[0])
        with bridge.dequantized():
            _, cache = bridge.run_with_cache(TOKENS, names_filter=names)
    o_proj = bridge.model.model.layers[0].self_attn.o_proj
    w_o = qlens.dequantize(o_proj)  # [d_model, head*d_head], the explicit route
    z_heads = cache[names[0]].sum(-2)
    torch.testing.assert_close(z_heads, cache[names[1]], rtol=1e-5, atol=1e-5)
    assert w_o.shape == (bridge.cfg.d_model, bridge.cfg.n_heads * bridge.cfg.d_head)
    # The opt-in ends with the block.
    with torch.no_grad(), pytest.raises(NotImplementedError):
        bridge.run_with_cache(TOKENS, names_filter=names[0])
