"""A format's codec: what qlens knows about one quantization format, held in one object.

A :class:`Codec` is registered once by name (``qlens.quant.codecs.registry.register_codec``);
``qlens.dequantize``, ``qlens.quantize`` / ``quantize_weight`` and the kernels read it from
there. The kernels layer attaches its part (``Codec.kernels``: launch view and Triton
dequantize, see ``qlens.kernels.formats``) when it is imported, so ``qlens.quant`` never
imports ``qlens.kernels``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qlens.quant.payload import QuantPayload

Dequantizer = Callable[[QuantPayload, torch.dtype], Tensor]
Validator = Callable[[QuantPayload], object]  # raises on a bad payload; the result is unused
ElementScales = Callable[[QuantPayload], Tensor]


@dataclass(frozen=True)
class QuantizeOptions:
    """The options of ``quantize_weight``; each scheme's quantizer checks the ones it takes."""

    scheme: str
    group_size: int | None = None
    block_size: int | tuple[int, int] | None = None
    scale_dtype: str | None = None
    asymmetric: bool = False


Quantizer = Callable[[Tensor, QuantizeOptions], QuantPayload]


@dataclass(eq=False)
class Codec:
    """One quantization format, by its payloads' ``format.name``.

    ``dequantize(payload, dtype)`` is the exact torch reconstruction; ``validate(payload)``
    raises a ValueError naming the first inconsistent tensor (``None``: ``dequantize`` checks
    its input itself). A format qlens quantizes to has ``quantize(weight, options)`` (a float32
    ``[*e, N, K]`` weight, already checked), the ``scheme`` name users pass (default: the
    format name), what the scheme does (``scheme_description``) and which of the optional
    ``quantize_weight`` arguments it takes (``quantize_options``). ``element_scales(payload)``
    gives the multiplier of every element, float32 ``[*e, N, K]`` (for error bounds).
    ``kernels`` is set by the kernels layer, once.
    """

    name: str
    dequantize: Dequantizer
    validate: Validator | None = None
    quantize: Quantizer | None = None
    scheme: str = ""
    scheme_description: str = ""
    quantize_options: Sequence[str] = ()
    element_scales: ElementScales | None = None
    kernels: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a codec needs a non-empty format name")
        if self.quantize is not None and not self.scheme:
            self.scheme = self.name
        if self.quantize is None and (self.scheme or self.quantize_options):
            raise ValueError(
                f"codec {self.name!r} names a quantize scheme or options but has no quantize "
                "function; pass quantize=..."
            )

    def check(self, payload: QuantPayload) -> None:
        """Raise a ValueError if ``payload`` is not a consistent payload of this format."""
        if payload.format.name != self.name:
            raise ValueError(
                f"the {self.name} codec cannot check a {payload.format.name} payload; use "
                f"codec_for({payload.format.name!r})"
            )
        if self.validate is not None:
            self.validate(payload)

    def attach_kernels(self, support: object) -> None:
        """Give the format its kernels part; a second attachment is an error."""
        if self.kernels is not None:
            raise ValueError(
                f"format {self.name!r} already has its kernels part ({self.kernels!r}); a "
                "format's kernels are attached once"
            )
        self.kernels = support
