"""Route a quantized matmul to the Triton kernel when the device supports it, else the torch reference."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.quant.expert_payloads import num_experts_of, select_expert
from qlens.modules.routing import route_to_experts
from qlens.quant.payload import QuantPayload

logger = logging.getLogger(__name__)


def payload_linear(
    x: Float[Tensor, "*batch in_features"],
    payload: QuantPayload,
    bias: Float[Tensor, " out_features"] | None = None,
) -> Float[Tensor, "*batch out_features"]:
    """``x @ W.T + bias`` for the weight ``W`` that ``payload`` encodes, in ``x``'s dtype.

    Uses ``qlens.kernels.quantized_linear`` on an accelerator that supports the payload's format;
    formats with only a dequantize kernel (bitsandbytes, GGUF, BitNet) take
    ``qlens.kernels.dequantized_linear`` (Triton dequantize, then cuBLAS) there; everything else
    runs ``qlens.kernels.reference_linear`` (torch dequantize, then matmul).
    """
    from qlens import kernels
    from qlens.kernels.dequant import has_dequantize_kernel
    from qlens.kernels.runtime import kernel_device_problem

    if x.device.type != "cpu":
        if kernels.supports(payload, x.device):
            return kernels.quantized_linear(x, payload, bias)
        if kernel_device_problem(x.device) is None and has_dequantize_kernel(payload):
            try:
                return kernels.dequantized_linear(x, payload, bias)
            except ValueError as err:  # a layout the kernel refuses: the reference still runs
                _warn_reference_on_accelerator(payload, x.device, str(err))
        else:
            _warn_reference_on_accelerator(payload, x.device)
    return kernels.reference_linear(x, payload, bias)


def experts_in_one_launch(payloads: tuple[QuantPayload, ...], x: Tensor, rows: int) -> bool:
    """True when ``rows`` (token, expert) pairs of fused experts ``payloads`` ``[experts, out,
    in]`` can run through ``qlens.kernels.experts_linear`` on ``x``'s accelerator: few enough
    rows for its one-launch GEMV, and formats the kernels read."""
    from qlens.kernels.experts import FUSED_EXPERT_ROWS, first_expert_view
    from qlens.kernels.runtime import kernel_device_problem

    if x.device.type == "cpu" or not 0 < rows <= FUSED_EXPERT_ROWS:
        return False
    if kernel_device_problem(x.device) is not None:
        return False
    return all(first_expert_view(p) is not None for p in payloads)


def fused_experts_forward(
    hidden_states: Float[Tensor, "tokens hidden"],
    top_k_index: Integer[Tensor, "tokens k"],
    top_k_weights: Float[Tensor, "tokens k"],
    first: QuantPayload,
    down: QuantPayload,
    first_bias: Float[Tensor, "experts inner"] | None,
    down_bias: Float[Tensor, "experts hidden"] | None,
    activate: Callable[[Tensor], Tensor],
) -> Float[Tensor, "tokens hidden"]:
    """``down(activate(first(x)))`` of fused ``[experts, out, in]`` payloads for every routed
    (token, expert) pair, weighted and summed as ``route_to_experts`` does (ids outside
    ``[0, experts of first)`` skipped).

    Few rows on an accelerator run each projection in one launch (``experts_in_one_launch``),
    with no host sync: the routing clamps the ids, so ``experts_linear`` skips its range check.
    Otherwise each hit expert runs its two payload linears.
    """
    num_experts = num_experts_of(first)

    def expert_fn(expert: int, x: Tensor) -> Tensor:
        h = payload_linear(x, select_expert(first, expert), _row(first_bias, expert))
        return payload_linear(activate(h), select_expert(down, expert), _row(down_bias, expert))

    def rows_fn(x: Tensor, ids: Tensor) -> Tensor:
        from qlens.kernels import experts_linear

        h = experts_linear(x, first, ids, first_bias, ids_in_range=True)
        return experts_linear(activate(h), down, ids, down_bias, ids_in_range=down_in_range)

    down_in_range = num_experts_of(down) >= num_experts
    one_launch = experts_in_one_launch((first, down), hidden_states, top_k_index.numel())
    return route_to_experts(
        hidden_states, top_k_index, top_k_weights, num_experts, expert_fn,
        rows_fn if one_launch else None,
    )  # fmt: skip


def _row(bias: Tensor | None, expert: int) -> Tensor | None:
    return None if bias is None else bias[expert]


_WARNED: set[tuple[str, str]] = set()


def _warn_reference_on_accelerator(
    payload: QuantPayload, device: torch.device, reason: str | None = None
) -> None:
    """Say once per format and reason that an accelerator runs the slow reference path."""
    from qlens.kernels.runtime import kernel_device_problem
    from qlens.kernels.weights import unsupported_reason

    reason = reason or kernel_device_problem(device) or unsupported_reason(payload) or "unsupported"
    key = (payload.format.name, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "qlens runs %s weights on %s with the torch reference (dequantize, then matmul), "
            "not its Triton kernels: %s",
            payload.format.name,
            device,
            reason,
        )


def check_payload_device(payload: QuantPayload, x: torch.Tensor, owner: str) -> None:
    """Raise when the activations and the packed weight live on different devices."""
    if payload.device != x.device:
        raise RuntimeError(
            f"{owner}: input is on {x.device} but its quantized weight is on {payload.device}; "
            f"move the model with .to({str(x.device)!r}) or the input to {str(payload.device)!r}"
        )
