"""QuantPayload: packed quantized data, its scales and everything needed to reconstruct it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from qlens.quant.formats import QuantFormat


@dataclass
class QuantPayload:
    """A quantized weight: packed data plus the metadata to dequantize it exactly.

    ``shape`` is the logical float shape, ``[out, in]`` for a linear weight or
    ``[experts, out, in]`` for fused experts. ``layout`` holds string/int/bool flags that change
    how ``data`` or ``scales`` are laid out (e.g. ``{"packing": "gptq", "scale_swizzle": "32_4_4",
    "gate_up": "interleaved"}``); ``extras`` holds further tensors a format needs (``g_idx``,
    nested absmax statistics, codebooks...).
    """

    format: QuantFormat
    data: torch.Tensor
    shape: tuple[int, ...]
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the payload by name (``extras`` prefixed with ``extra.``)."""
        named = {"data": self.data}
        for name in ("scales", "zeros", "global_scale"):
            value = getattr(self, name)
            if value is not None:
                named[name] = value
        named.update({f"extra.{k}": v for k, v in self.extras.items()})
        return named

    @property
    def nbytes(self) -> int:
        """Bytes held by every tensor of the payload."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def numel(self) -> int:
        """Number of logical weight elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per logical weight, scales and zero points included."""
        return 8.0 * self.nbytes / max(self.numel, 1)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> QuantPayload:
        """A copy of the payload with every tensor on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            data=self.data.to(device),
            scales=move(self.scales),
            zeros=move(self.zeros),
            global_scale=move(self.global_scale),
            extras={k: v.to(device) for k, v in self.extras.items()},
        )

    def _repr_html_(self) -> str:
        from qlens.rich_repr import render_html

        return render_html("payload", self)

    def __repr__(self) -> str:
        parts = [f"format={self.format.name}", f"shape={list(self.shape)}"]
        for name, t in self.tensors().items():
            parts.append(f"{name}={t.dtype}{list(t.shape)}")
        if self.layout:
            parts.append(f"layout={self.layout}")
        parts.append(f"{self.bits_per_weight:.2f} bits/weight")
        parts.append(f"device={self.device}")
        return "QuantPayload(" + ", ".join(parts) + ")"
