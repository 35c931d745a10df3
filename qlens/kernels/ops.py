"""The ``qlens::`` custom ops: quantized linears as single graph nodes for ``torch.compile``.

Each op takes only tensors, a payload spec key (``PayloadSpec.key``: format, shape and layout as
one JSON string) and an optional bias, so a module's forward traces with no graph break. The
CUDA implementation runs the same dispatcher as an eager call (:func:`qlens.kernels.linear`);
the CPU implementation is the torch reference. ``torch.compile`` specializes on the spec key
(a constant), so each quantized layer's format and shape is baked into the graph.
"""

# No ``from __future__ import annotations``: the ops' schemas are read from real annotations.

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.quant.payload_spec import spec_from_key


@torch.library.custom_op("qlens::linear", mutates_args=())
def linear_op(x: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for the payload ``spec_from_key(spec).build(tensors)``."""
    from qlens.kernels.plan import linear

    return linear(x, spec_from_key(spec).build(tensors), bias)


@linear_op.register_fake
def _linear_fake(x: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], spec_from_key(spec).shape[0]))


@torch.library.custom_op("qlens::experts_linear", mutates_args=())
def experts_linear_op(
    x: Tensor, expert_ids: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None = None
) -> Tensor:
    """Row ``i`` of ``x`` through expert ``expert_ids[i]`` (in range) of the fused experts
    payload ``spec_from_key(spec).build(tensors)``, plus that expert's bias row."""
    from qlens.kernels.experts import rows_through_experts

    return rows_through_experts(x, spec_from_key(spec).build(tensors), expert_ids, bias)


@experts_linear_op.register_fake
def _experts_linear_fake(
    x: Tensor, expert_ids: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None = None
) -> Tensor:
    return x.new_empty((x.shape[0], spec_from_key(spec).shape[1]))


def compiled_linear(
    x: Float[Tensor, "*batch k"], tensors: list[Tensor], spec: str, bias: Tensor | None
) -> Float[Tensor, "*batch n"]:
    """``qlens::linear`` (what a module's forward calls while ``torch.compile`` traces it)."""
    return torch.ops.qlens.linear(x, tensors, spec, bias)


def compiled_experts_linear(
    x: Float[Tensor, "rows k"],
    expert_ids: Integer[Tensor, " rows"],
    tensors: list[Tensor],
    spec: str,
    bias: Tensor | None,
) -> Float[Tensor, "rows n"]:
    """``qlens::experts_linear`` (what an experts forward calls while compiling)."""
    return torch.ops.qlens.experts_linear(x, expert_ids, tensors, spec, bias)
