"""The ``qlens::`` ops: quantized linears as single graph nodes for ``torch.compile``.

Each op takes only tensors, a payload spec key (``PayloadSpec.key``: format, shape and layout as
one JSON string) and an optional bias, so a module's forward traces with no graph break. The
CUDA implementation runs the same dispatcher as an eager call (:func:`qlens.kernels.linear`);
the CPU implementation is the torch reference. ``torch.compile`` specializes on the spec key
(a constant), so each quantized layer's format and shape is baked into the graph. The ops are
defined through ``qlens.kernels.op_library`` (cheap for the host to call); the ``*_op``
names hold their ``OpOverload`` objects.
"""

# No ``from __future__ import annotations``: the ops' schemas are read from real annotations.

from collections.abc import Sequence

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.op_library import qlens_op
from qlens.kernels.op_payloads import payload_for_op, plan_for_op
from qlens.quant.payload import QuantPayload
from qlens.quant.payload_spec import spec_from_key, split_keys


@qlens_op("linear")
def _linear(x: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None) -> Tensor:
    """``x @ W.T + bias`` for the payload ``spec_from_key(spec).build(tensors)`` (the module's
    own payload and kept plan when it offered them: ``op_payloads``), as an eager call runs it."""
    return plan_for_op(spec, tensors, x.device)(x, bias)


@_linear.register_fake
def _linear_fake(x: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None) -> Tensor:
    out_features, in_features = spec_from_key(spec).shape
    if x.shape[-1] != in_features:  # checked once, when traced (the modules' compiled forward)
        raise ValueError(
            f"the quantized linear expects inputs with {in_features} features in the last dim; "
            f"got shape {list(x.shape)}"
        )
    return x.new_empty((*x.shape[:-1], out_features))


@qlens_op("w8a8_linear")
def _w8a8_linear(x: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None) -> Tensor:
    """``qlens::linear`` with the activations quantized to FP8 per token and K block first
    (block FP8 weights: ``LinearPlan(w8a8=True)``)."""
    return plan_for_op(spec, tensors, x.device, w8a8=True)(x, bias)


_w8a8_linear.register_fake(_linear_fake)


@qlens_op("sibling_linear")
def _sibling_linear(
    x: Tensor, tensors: list[Tensor], specs: str, biases: list[Tensor | None]
) -> Tensor:
    """``qlens::linear`` of each payload on the same ``x``, concatenated along the last dim:
    one launch for one row (``qlens.kernels.stacked_linear``). ``specs``: the payloads' spec
    keys, joined by ``joined_keys``; each payload's tensors follow the previous one's in
    ``tensors``. Compiled graphs get it from ``qlens.kernels.sibling_fusion``."""
    from qlens.kernels.stacked_linear import stacked_linear

    return stacked_linear(x, _op_payloads(specs, tensors), biases)


@_sibling_linear.register_fake
def _sibling_linear_fake(
    x: Tensor, tensors: list[Tensor], specs: str, biases: list[Tensor | None]
) -> Tensor:
    return x.new_empty((*x.shape[:-1], stacked_width(specs)))


def stacked_width(specs: str) -> int:
    """The output width of the sibling ops for these joined spec keys."""
    return sum(spec_from_key(s).shape[0] for s in split_keys(specs))


def _op_payloads(specs: str, tensors: Sequence[Tensor]) -> list[QuantPayload]:
    """The payloads of the joined spec keys ``specs``, each taking its ``tensor_names`` from
    ``tensors`` in turn."""
    payloads, start = [], 0
    for spec in split_keys(specs):
        count = len(spec_from_key(spec).tensor_names)
        payloads.append(payload_for_op(spec, tensors[start : start + count]))
        start += count
    return payloads


@qlens_op("linear_backward")
def _linear_backward(grad: Tensor, tensors: list[Tensor], spec: str) -> Tensor:
    """The input gradient ``grad @ W`` of ``qlens::linear`` (``W`` from the torch dequantize)."""
    weight = _dequantized(spec, tensors, grad.device)
    return (grad.float() @ weight).to(grad.dtype)


@_linear_backward.register_fake
def _linear_backward_fake(grad: Tensor, tensors: list[Tensor], spec: str) -> Tensor:
    return grad.new_empty((*grad.shape[:-1], spec_from_key(spec).shape[1]))


def _linear_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, tensors, spec, bias = inputs
    ctx.spec, ctx.bias_dtype = spec, None if bias is None else bias.dtype
    ctx.save_for_backward(*tensors)


def _linear_grads(ctx, grad):  # type: ignore[no-untyped-def]
    grad_x = torch.ops.qlens.linear_backward(grad, list(ctx.saved_tensors), ctx.spec)
    grad_bias = None
    if ctx.bias_dtype is not None:
        grad_bias = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, grad_bias


_linear.register_autograd(_linear_grads, setup_context=_linear_setup)
# The activations' FP8 rounding passes the gradient straight through.
_w8a8_linear.register_autograd(_linear_grads, setup_context=_linear_setup)


def _dequantized(spec: str, tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    from qlens.quant.dequantize import dequantize

    return dequantize(spec_from_key(spec).build(list(tensors)), torch.float32).to(device)


@qlens_op("experts_linear")
def _experts_linear(
    x: Tensor, expert_ids: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None
) -> Tensor:
    """Row ``i`` of ``x`` through expert ``expert_ids[i]`` (in range) of the fused experts
    payload ``spec_from_key(spec).build(tensors)``, plus that expert's bias row."""
    from qlens.kernels.experts import rows_through_experts

    return rows_through_experts(x, payload_for_op(spec, tensors), expert_ids, bias)


@_experts_linear.register_fake
def _experts_linear_fake(
    x: Tensor, expert_ids: Tensor, tensors: list[Tensor], spec: str, bias: Tensor | None
) -> Tensor:
    return x.new_empty((x.shape[0], spec_from_key(spec).shape[1]))


@qlens_op("experts_linear_backward")
def _experts_linear_backward(
    grad: Tensor, expert_ids: Tensor, tensors: list[Tensor], spec: str
) -> Tensor:
    """The input gradient of ``qlens::experts_linear``: row ``i`` is ``grad[i] @ W[ids[i]]``."""
    weights = _dequantized(spec, tensors, grad.device)
    grad_x = grad.new_empty((grad.shape[0], weights.shape[-1]), dtype=torch.float32)
    for expert in torch.unique(expert_ids).tolist():
        rows = torch.nonzero(expert_ids == expert).squeeze(1)
        grad_x[rows] = grad[rows].float() @ weights[expert]
    return grad_x.to(grad.dtype)


@_experts_linear_backward.register_fake
def _experts_linear_backward_fake(
    grad: Tensor, expert_ids: Tensor, tensors: list[Tensor], spec: str
) -> Tensor:
    return grad.new_empty((grad.shape[0], spec_from_key(spec).shape[2]))


def _experts_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, expert_ids, tensors, spec, bias = inputs
    ctx.spec, ctx.bias_dtype = spec, None if bias is None else bias.dtype
    ctx.num_experts = spec_from_key(spec).shape[0]
    ctx.save_for_backward(expert_ids, *tensors)


def _experts_grads(ctx, grad):  # type: ignore[no-untyped-def]
    expert_ids, *tensors = ctx.saved_tensors
    grad_x = torch.ops.qlens.experts_linear_backward(grad, expert_ids, tensors, ctx.spec)
    grad_bias = None
    if ctx.bias_dtype is not None:
        grad_bias = (
            torch.zeros((ctx.num_experts, grad.shape[-1]), dtype=torch.float32, device=grad.device)
            .index_add_(0, expert_ids, grad.float())
            .to(ctx.bias_dtype)
        )
    return grad_x, None, None, None, grad_bias


_experts_linear.register_autograd(_experts_grads, setup_context=_experts_setup)

# The ops' OpOverloads: what graphs record and ``torch.library.opcheck`` takes.
linear_op = _linear.default
w8a8_linear_op = _w8a8_linear.default
sibling_linear_op = _sibling_linear.default
linear_backward_op = _linear_backward.default
experts_linear_op = _experts_linear.default
experts_linear_backward_op = _experts_linear_backward.default


def compiled_linear(
    x: Float[Tensor, "*batch k"],
    tensors: list[Tensor],
    spec: str,
    bias: Tensor | None,
    w8a8: bool = False,
) -> Float[Tensor, "*batch n"]:
    """What a module's forward calls while ``torch.compile`` traces it: ``qlens::linear``
    (``qlens::w8a8_linear`` with ``w8a8``), the op that runs what an eager call runs."""
    if w8a8:
        return torch.ops.qlens.w8a8_linear(x, tensors, spec, bias)
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
