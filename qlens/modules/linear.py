"""QuantLinear: a linear layer whose weight is a quantized payload (no float ``weight``)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from qlens.kernels.ops import compiled_linear
from qlens.kernels.plan import require_w8a8
from qlens.modules.payload_buffers import PayloadModule, traced_payload
from qlens.modules.siblings import SiblingGroup
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
    ``torch.compile`` it is one ``qlens::linear`` op (``qlens::w8a8_linear`` with ``w8a8``).

    ``w8a8=True`` (block FP8 weights only) also quantizes the activations, per token and
    block of 128 along K, to FP8 (scale ``amax / 448``) and multiplies on FP8 tensor cores:
    the forward of DeepSeek-style FP8 checkpoints (transformers' ``FP8Linear``). It is a
    property: set it on a built module to compare both numerics on the same weights
    (``qlens.set_w8a8`` sets it model-wide).
    """

    def __init__(
        self, payload: QuantPayload, bias: Tensor | None = None, *, w8a8: bool = False
    ) -> None:
        super().__init__()
        self._w8a8 = False
        # Set by qlens.modules.siblings.SiblingGroup: siblings that may share one launch.
        self._sibling_group: SiblingGroup | None = None
        self._sibling_index = 0
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
        self.w8a8 = w8a8

    @property
    def w8a8(self) -> bool:
        """Whether the activations are quantized to FP8 too (W8A8), not only the weight."""
        return self._w8a8

    @w8a8.setter
    def w8a8(self, value: bool) -> None:
        if value:
            spec = self._payload_specs["weight"]
            require_w8a8(spec.format, spec.shape)
        if bool(value) != self._w8a8:
            self._w8a8 = bool(value)
            self._plans.pop("weight", None)  # the kept plan ran the other numerics
            if self._sibling_group is not None:
                self._sibling_group.forget()
        self.trace_with("weight", self._w8a8)

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
            traced = self._traced_weight
            tensors, key = traced_payload(self._buffers, traced)
            return compiled_linear(x, tensors, key, self.bias, traced[2])
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"QuantLinear expects inputs with {self.in_features} features in the last dim; "
                f"got shape {list(x.shape)}"
            )
        group = self._sibling_group
        if group is not None:
            shared = group.output(self._sibling_index, x)
            if shared is not None:
                return shared
        return self.linear_plan("weight", x, self._w8a8)(x, self.bias)

    def forget_prepared(self) -> None:
        super().forget_prepared()
        if self._sibling_group is not None:  # the buffers changed: so does the shared launch
            self._sibling_group.forget()

    def extra_repr(self) -> str:
        payload = self.payload
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={payload.format.name}, "
            f"block={tuple(payload.format.block)}, "
            f"{payload.bits_per_weight:.2f} bits/weight" + (", w8a8=True" if self._w8a8 else "")
        )
