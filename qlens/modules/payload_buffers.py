"""Keep a QuantPayload's tensors as module buffers, so ``.to()``, state_dict and device maps see them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

_OPTIONAL = ("scales", "zeros", "global_scale")


@dataclass(frozen=True)
class PayloadSpec:
    """Everything of a payload that is not a tensor, plus which optional tensors it holds."""

    format: QuantFormat
    shape: tuple[int, ...]
    layout: dict[str, Any] = field(default_factory=dict)
    present: tuple[str, ...] = ()  # names among scales, zeros, global_scale
    extras: tuple[str, ...] = ()


def buffer_name(prefix: str, tensor_name: str) -> str:
    """Buffer holding one payload tensor: ``{prefix}_data``, ``{prefix}_scales``, ``{prefix}_extra_<k>``."""
    return f"{prefix}_{tensor_name.replace('.', '_')}"


class PayloadModule(nn.Module):
    """Base of modules whose quantized weights live in payloads registered as buffers.

    Payload buffers follow device moves but keep their dtype: ``model.to(torch.bfloat16)`` or
    ``.half()`` casts biases and other float tensors, never packed data or scales (an fp8 weight
    or an fp32 scale cast to bf16 would silently change the weight).
    """

    def __init__(self) -> None:
        super().__init__()
        self._payload_specs: dict[str, PayloadSpec] = {}

    def register_payload(self, prefix: str, payload: QuantPayload) -> None:
        """Register every tensor of ``payload`` as a persistent buffer under ``prefix``."""
        present = tuple(n for n in _OPTIONAL if getattr(payload, n) is not None)
        spec = PayloadSpec(
            format=payload.format,
            shape=tuple(int(s) for s in payload.shape),
            layout=dict(payload.layout),
            present=present,
            extras=tuple(payload.extras),
        )
        self._payload_specs[prefix] = spec
        for name, tensor in payload.tensors().items():
            self.register_buffer(buffer_name(prefix, name), tensor)

    def payload_for(self, prefix: str) -> QuantPayload:
        """The payload registered under ``prefix``, built on the buffers as they are now."""
        spec = self._payload_specs[prefix]
        optional = {n: self._payload_buffer(prefix, n) for n in spec.present}
        return QuantPayload(
            format=spec.format,
            data=self._payload_buffer(prefix, "data"),
            shape=spec.shape,
            layout=dict(spec.layout),
            extras={k: self._payload_buffer(prefix, f"extra.{k}") for k in spec.extras},
            **optional,
        )

    def _payload_buffer(self, prefix: str, tensor_name: str) -> torch.Tensor:
        tensor = self._buffers[buffer_name(prefix, tensor_name)]
        if tensor is None:
            raise RuntimeError(f"payload buffer {buffer_name(prefix, tensor_name)} was set to None")
        return tensor

    def payload_specs(self) -> dict[str, PayloadSpec]:
        """The non-tensor description of each registered payload, by prefix."""
        return dict(self._payload_specs)

    def _payload_buffer_names(self) -> list[str]:
        names: list[str] = []
        for prefix, spec in self._payload_specs.items():
            tensor_names = ["data", *spec.present, *(f"extra.{k}" for k in spec.extras)]
            names.extend(buffer_name(prefix, n) for n in tensor_names)
        return names

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> PayloadModule:
        originals = {name: self._buffers[name] for name in self._payload_buffer_names()}
        super()._apply(fn, recurse)
        for name, original in originals.items():
            moved = self._buffers[name]
            if original is not None and moved is not None and moved.dtype != original.dtype:
                self._buffers[name] = original.to(device=moved.device)
        return self
