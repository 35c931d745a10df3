"""The ``qlens::`` ops as ``qlens.kernels.op_library`` defines them: gradients recorded only when
an input needs one, a clear error for ops without a backward, and no ``torch.autograd.Function``
on the no-grad path."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from qlens.kernels import ops, reference_linear
from qlens.kernels.op_library import qlens_op
from qlens.quant.dequantize import dequantize
from qlens.quant.payload_spec import PayloadSpec, joined_keys
from qlens.quant.quantize import quantize_weight


def _op_arguments(payload) -> tuple[list[torch.Tensor], str]:  # type: ignore[no-untyped-def]
    return list(payload.tensors().values()), PayloadSpec.of(payload).key


@contextmanager
def _function_applies() -> Iterator[list[int]]:
    """Count the calls of ``torch.autograd.Function.apply`` (any Function) in this thread."""
    code = torch.autograd.Function.apply.__func__.__code__
    calls: list[int] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code is code:
            calls.append(1)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("grad_mode", [False, True])
def test_a_call_needing_no_gradient_runs_no_autograd_function(grad_mode: bool) -> None:
    payload = quantize_weight(torch.randn(40, 64), "int4")
    tensors, key = _op_arguments(payload)
    x = torch.randn(3, 64)
    with torch.set_grad_enabled(grad_mode), _function_applies() as calls:
        out = ops.linear_op(x, tensors, key, None)
    assert calls == [] and out.grad_fn is None
    torch.testing.assert_close(out, reference_linear(x, payload))
    with _function_applies() as calls:  # an input that needs one records the call
        out = ops.linear_op(x.requires_grad_(), tensors, key, None)
    assert calls == [1] and out.grad_fn is not None


def test_the_linear_ops_gradients_are_the_dequantized_weights() -> None:
    payload = quantize_weight(torch.randn(40, 64), "int4")
    tensors, key = _op_arguments(payload)
    x, bias = torch.randn(2, 3, 64, requires_grad=True), torch.randn(40, requires_grad=True)
    grad = torch.randn(2, 3, 40)
    ops.linear_op(x, tensors, key, bias).backward(grad)
    torch.testing.assert_close(x.grad, grad @ dequantize(payload, torch.float32))
    torch.testing.assert_close(bias.grad, grad.sum((0, 1)))


def test_the_experts_ops_gradients_are_each_rows_expert() -> None:
    payload = quantize_weight(torch.randn(3, 40, 64), "int4")
    tensors, key = _op_arguments(payload)
    ids = torch.tensor([2, 0, 2, 1])
    x, bias = torch.randn(4, 64, requires_grad=True), torch.randn(3, 40, requires_grad=True)
    grad = torch.randn(4, 40)
    ops.experts_linear_op(x, ids, tensors, key, bias).backward(grad)
    weights = dequantize(payload, torch.float32)
    expected_bias = torch.zeros(3, 40).index_add_(0, ids, grad)
    torch.testing.assert_close(
        x.grad, torch.stack([grad[i] @ weights[e] for i, e in enumerate(ids)])
    )
    torch.testing.assert_close(bias.grad, expected_bias)


def _sibling_call(bias_grad: bool) -> Callable[[], torch.Tensor]:
    payloads = [quantize_weight(torch.randn(n, 64), "int4") for n in (32, 16)]
    tensors = [t for p in payloads for t in p.tensors().values()]
    specs = joined_keys([PayloadSpec.of(p).key for p in payloads])
    biases = [torch.randn(32), torch.randn(16, requires_grad=bias_grad)]
    return lambda: ops.sibling_linear_op(torch.randn(1, 64), tensors, specs, biases)


def test_an_op_without_a_backward_refuses_an_input_that_requires_grad() -> None:
    payload = quantize_weight(torch.randn(40, 64), "int4")
    tensors, key = _op_arguments(payload)
    grad = torch.randn(3, 40, requires_grad=True)
    message = r"qlens::linear_backward has no gradient.*torch\.no_grad\(\)"
    with pytest.raises(RuntimeError, match=message):
        ops.linear_backward_op(grad, tensors, key)
    with torch.no_grad():
        assert ops.linear_backward_op(grad, tensors, key).shape == (3, 64)
    # A tensor in a Tensor?[] input counts too.
    with pytest.raises(RuntimeError, match="qlens::sibling_linear has no gradient"):
        _sibling_call(bias_grad=True)()
    assert _sibling_call(bias_grad=False)().shape == (1, 48)


def test_ops_take_positional_arguments_without_defaults() -> None:
    def scaled(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    with pytest.raises(TypeError, match="'factor' is not"):
        qlens_op("scaled_for_a_test")(scaled)
    assert not hasattr(torch.ops.qlens, "scaled_for_a_test")  # refused before it was defined
