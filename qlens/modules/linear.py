"""QuantLinear: a linear layer whose weight is a quantized payload (no float ``weight``)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from qlens.kernels.ops import compiled_linear
from qlens.modules.payload_buffers import PayloadModule, traced_payload
from qlens.quant.payload import QuantPayload

_WEIGHT_MESSAGE = (
    "QuantLinear holds a quantized payload, not a float weight, so it has no `.weight`. "
    "Read the packed weight with `.payload`, or the float matrix [out, in] with "
    "`qlens.dequantize(module)` (or `qlens.dequantize(module.payload)`)."
)


class QuantLinear(PayloadModule):
    """``y = x @ W.T + b`` with ``W`` [out, in] held as a :class:`QuantPayload`.

    The payload's tensors are buffers (they move with ``.to()``, appear in ``state_dict`` and
    follow device maps). The forward runs ``qlens.kernels.linear``: qlens' Triton kernel on a
    supporting accelerator and the torch reference (dequantize then matmul) elsewhere, with
    the payload and its launch plan built once and kept until the buffers change. Under
    ``torch.compile`` it is one ``qlens::linear`` op.
    """

    def __init__(self, payload: QuantPayload, bias: Tensor | None = None) -> None:
        super().__init__()
        if len(payload.shape) != 2:
            raise ValueError(
                f"QuantLinear needs a 2-D [out, in] payload; got shape {list(payload.shape)} "
                f"(use QuantExperts for [experts, out, in] payloads)"
            )
        self.out_features, self.in_features = (int(s) for s in payload.shape)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(
                f"bias has shape {list(bias.shape)} but the weight has {self.out_features} "
                f"output features; pass a bias of shape [{self.out_features}] or None"
            )
        self.register_payload("weight", payload)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @property
    def payload(self) -> QuantPayload:
        """The quantized weight, on the module's current device."""
        return self.payload_for("weight")

    def __getattr__(self, name: str) -> Any:
        if name == "weight":
            raise AttributeError(_WEIGHT_MESSAGE)
        return super().__getattr__(name)

    def forward(
        self, x: Float[Tensor, "*batch in_features"]
    ) -> Float[Tensor, "*batch out_features"]:
        if torch.compiler.is_compiling():  # the op's fake checks the shape, once, when traced
            tensors, key = traced_payload(self._buffers, self._traced_weight)
            return compiled_linear(x, tensors, key, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"QuantLinear expects inputs with {self.in_features} features in the last dim; "
                f"got shape {list(x.shape)}"
            )
        return self.linear_plan("weight", x)(x, self.bias)

    def extra_repr(self) -> str:
        payload = self.payload
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={payload.format.name}, "
            f"block={tuple(payload.format.block)}, "
            f"{payload.bits_per_weight:.2f} bits/weight"
        )
