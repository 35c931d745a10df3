"""What each attention head and each MLP neuron writes into the residual stream."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.analysis.slicing import Slice, SliceInput
from qlens.weights import accessors


def head_results(
    bridge: Any, cache: Any, layer: int, *, dequantize: bool = False
) -> Float[Tensor, "*batch pos head d_model"]:
    """Each head's output ``z_h @ W_O[h]`` at ``layer`` (bias excluded), TransformerLens'
    ``attn.hook_result``. Needs ``attn.hook_z`` in the cache; W_O is read through the guard
    (``dequantize`` opts in)."""
    z = cache[f"blocks.{layer}.attn.hook_z"]
    w_o = accessors.W_O(bridge, layer, dequantize=dequantize).to(z.dtype)
    return torch.einsum("...hd,hdm->...hm", z, w_o)


def neuron_results(
    bridge: Any,
    cache: Any,
    layer: int,
    neuron_slice: SliceInput = None,
    *,
    dequantize: bool = False,
) -> Float[Tensor, "*batch pos neuron d_model"]:
    """Each MLP neuron's output ``post_n * W_out[n]`` at ``layer`` (bias excluded), for the
    neurons ``neuron_slice`` selects (TransformerLens ``Slice`` semantics; an int keeps the
    axis). Needs ``mlp.hook_post`` in the cache; W_out is read through the guard."""
    if accessors.layer_module(bridge, layer, "experts") is not None:
        raise ValueError(
            f"neuron results (expand_neurons) are not defined for the mixture-of-experts layer "
            f"{layer}: its neurons belong to experts that each see different tokens; decompose "
            "by MLP output instead (expand_neurons=False)"
        )
    neurons = Slice(neuron_slice)
    if neurons.mode == "int":
        neurons = Slice([neurons.index])
    post = neurons.apply(cache[f"blocks.{layer}.mlp.hook_post"], -1)
    w_out = neurons.apply(accessors.W_out(bridge, layer, dequantize=dequantize), 0)
    return post[..., :, None] * w_out.to(post.dtype)
