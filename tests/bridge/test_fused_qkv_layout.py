"""Where q, k and v sit in a fused qkv projection's output (``FusedQKV``), against the module
layouts of GPT-2/Phi-3 (``[all q | all k | all v]``) and GPT-NeoX (each head's ``[q k v]``)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.bridge.projection_taps import FusedQKV
from qlens.bridge.split_inputs import own_heads


@st.composite
def fused_layouts(draw: st.DrawFn) -> FusedQKV:
    layout = draw(st.sampled_from(["qkv_blocks", "per_head_qkv"]))
    n_kv_heads = draw(st.integers(1, 4))
    n_heads = n_kv_heads * (draw(st.integers(1, 3)) if layout == "qkv_blocks" else 1)
    return FusedQKV(layout, n_heads, n_kv_heads, draw(st.integers(1, 5)))


@given(fused=fused_layouts(), batch=st.integers(1, 3))
def test_split_finds_each_heads_q_k_v_and_join_inverts_it(fused: FusedQKV, batch: int) -> None:
    n_q, n_kv, d = fused.n_heads, fused.n_kv_heads, fused.d_head
    width = (n_q + 2 * n_kv) * d
    output = torch.arange(batch * width, dtype=torch.float32).reshape(batch, width)
    q, k, v = fused.split(output)
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (n_q * d, n_kv * d, n_kv * d)
    for role, part in enumerate((q, k, v)):
        for head in range(part.shape[-1] // d):
            if fused.layout == "per_head_qkv":  # GPT-NeoX: view(head, 3, d_head)
                start = (head * 3 + role) * d
            else:  # the q block, then the k block, then the v block
                start = [0, n_q * d, (n_q + n_kv) * d][role] + head * d
            expected = output[:, start : start + d]
            assert torch.equal(part[:, head * d : (head + 1) * d], expected), (role, head)
    assert torch.equal(fused.join([q, k, v]), output)


@given(copies=st.integers(1, 4), d_head=st.integers(1, 4))
def test_own_heads_keeps_head_h_of_copy_h(copies: int, d_head: int) -> None:
    projected = torch.randn(2, 3, copies, copies * d_head)  # [batch pos copy head*d_head]
    own = own_heads(projected, d_head)
    for h in range(copies):
        sliced = projected[:, :, h, h * d_head : (h + 1) * d_head]
        assert torch.equal(own[..., h * d_head : (h + 1) * d_head], sliced)
