"""The kernels' part of each format, attached to its codec: launch view and Triton dequantize.

A :class:`KernelSupport` says how the kernels read a format: ``family`` (the kernels'
compile-time format code) with ``view`` (payload -> checked :class:`KernelWeight`, raising a
ValueError naming what does not match) for the fused kernels, and ``triton_dequantize``
(``fn(payload, dtype, *, launch, check_values) -> Tensor``) for a dense Triton decode. Importing
this module attaches the built-in formats' parts; a new format attaches its own with
:func:`attach_kernel_support`. Triton is imported only when a Triton dequantize first runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from qlens.kernels.bnb_view import bnb_4bit_view, bnb_int8_view
from qlens.kernels.layout_view import (
    BNB4,
    FP8_BLOCK,
    INT4,
    INT8,
    MXFP4,
    MXFP8,
    NVFP4,
    KernelWeight,
    qlens_layout_view,
)
from qlens.quant.codecs.gguf import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, gguf_format
from qlens.quant.codecs.registry import codec_for, codecs
from qlens.quant.payload import QuantPayload

TritonDequantize = Callable[..., Tensor]

# Formats whose payloads keep their library's own packing, each with a Triton kernel of its own;
# bitsandbytes' are read by the fused kernels too (``qlens.kernels.bnb_view``).
BNB_FORMATS = ("bnb_nf4", "bnb_fp4", "bnb_int8")
BNB_4BIT_FORMATS = ("bnb_nf4", "bnb_fp4")
GGUF_KERNEL_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
GGUF_KERNEL_FORMATS = tuple(gguf_format(t).name for t in GGUF_KERNEL_TYPES)
BITNET_FORMATS = ("bitnet",)


@dataclass(frozen=True)
class KernelSupport:
    """How the kernels read one format (see the module docstring).

    ``family`` and ``view`` come together or not at all. ``dequantize_reads_any_layout``: the
    Triton dequantize also reads payloads the view refuses (a library's own kernel), not only
    those the fused kernels read. ``stacked_experts``: the view also reads ``[experts, out, in]``
    payloads (qlens' layouts), so the experts' kernels run the format."""

    family: int | None = None
    view: Callable[[QuantPayload], KernelWeight] | None = None
    triton_dequantize: TritonDequantize | None = None
    dequantize_reads_any_layout: bool = False
    stacked_experts: bool = True

    def __post_init__(self) -> None:
        if (self.family is None) != (self.view is None):
            raise ValueError(
                "KernelSupport takes family and view together (the fused kernels need both) "
                f"or neither, got family={self.family!r}, view={self.view!r}"
            )
        if self.view is None and self.triton_dequantize is None:
            raise ValueError(
                "KernelSupport needs a family with its view, a triton_dequantize, or both"
            )


class _Deferred:
    """``module.function``, imported on the first call (the Triton modules need Triton)."""

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function
        self._resolved: TritonDequantize | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        if self._resolved is None:
            self._resolved = getattr(importlib.import_module(self.module), self.function)
        return self._resolved(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.module}.{self.function}"


def attach_kernel_support(format_name: str, support: KernelSupport) -> None:
    """Give the registered format ``format_name`` its kernels part (once)."""
    if not isinstance(support, KernelSupport):
        raise TypeError(
            f"attach_kernel_support takes a KernelSupport, got {type(support).__name__}"
        )
    codec_for(format_name).attach_kernels(support)


def kernel_support(format_name: str) -> KernelSupport | None:
    """The kernels part of ``format_name`` (``None``: not read by the kernels, or unknown)."""
    try:
        support = codec_for(format_name).kernels
    except ValueError:
        return None
    return support if isinstance(support, KernelSupport) else None


def fused_kernel_formats() -> list[str]:
    """The formats the fused kernels read (those with a family and launch view), sorted."""
    return sorted(
        c.name for c in codecs() if isinstance(c.kernels, KernelSupport) and c.kernels.view
    )


def expert_kernel_formats() -> list[str]:
    """The formats whose stacked experts the fused kernels read, sorted."""
    return sorted(
        c.name
        for c in codecs()
        if isinstance(c.kernels, KernelSupport) and c.kernels.view and c.kernels.stacked_experts
    )


def kernel_families() -> dict[str, int]:
    """Each fused-kernel format's family code, by format name."""
    return {
        c.name: c.kernels.family
        for c in codecs()
        if isinstance(c.kernels, KernelSupport) and c.kernels.family is not None
    }


def _attach_builtin_formats() -> None:
    qlens_layout_dequantize = _Deferred("qlens.kernels.dequant", "dequantize_qlens_layout")
    families = {"fp8_block": FP8_BLOCK, "mxfp8": MXFP8, "mxfp4": MXFP4, "nvfp4": NVFP4,
                "int4": INT4, "int8": INT8}  # fmt: skip
    for name, family in families.items():
        view = functools.partial(qlens_layout_view, family=family)
        attach_kernel_support(name, KernelSupport(family, view, qlens_layout_dequantize))
    bnb_dequantize = _Deferred("qlens.kernels.dequant_bnb", "dequantize_bnb_triton")
    bnb_views: dict[str, tuple[int, Callable[[QuantPayload], KernelWeight]]] = {
        name: (BNB4, bnb_4bit_view) for name in BNB_4BIT_FORMATS
    }
    bnb_views["bnb_int8"] = (INT8, bnb_int8_view)
    for name, (family, bnb_view) in bnb_views.items():
        attach_kernel_support(
            name,
            KernelSupport(
                family, bnb_view, bnb_dequantize,
                dequantize_reads_any_layout=True, stacked_experts=False,
            ),
        )  # fmt: skip
    library_kernels = (
        (GGUF_KERNEL_FORMATS, _Deferred("qlens.kernels.dequant_gguf", "dequantize_gguf_triton")),
        (BITNET_FORMATS, _Deferred("qlens.kernels.dequant_bitnet", "dequantize_bitnet_triton")),
    )
    for names, kernel in library_kernels:
        for name in names:
            attach_kernel_support(name, KernelSupport(triton_dequantize=kernel))


_attach_builtin_formats()
