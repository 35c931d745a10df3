"""The weight payloads the Triton kernels read, checked and reduced to launch arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from qlens.kernels.formats import fused_kernel_formats, kernel_families, kernel_support
from qlens.kernels.layout_view import KernelWeight
from qlens.quant.payload import QuantPayload

if TYPE_CHECKING:
    from torch import Tensor

T = TypeVar("T")


def unsupported_reason(payload: QuantPayload) -> str | None:
    """Why the kernels cannot read ``payload`` (``None`` when they can); kept on the payload
    (``cached_on_payload``), so a format the kernels refuse is not re-checked every forward."""
    return cached_on_payload(payload, "unsupported_reason", _reason)


def _reason(payload: QuantPayload) -> str | None:
    try:
        kernel_weight(payload)
    except ValueError as err:
        return str(err)
    return None


def payload_sources(payload: QuantPayload) -> tuple[Tensor | None, ...]:
    """The tensors a value kept on ``payload`` was built from (compared by identity)."""
    return (payload.data, payload.scales, payload.zeros, payload.global_scale)


def cached_on_payload(
    payload: QuantPayload,
    name: str,
    build: Callable[[QuantPayload], T],
    keep: Callable[[T], bool] = lambda value: True,
) -> T:
    """``build(payload)``, kept on the payload under ``name`` and returned again while its tensors
    are the same objects and its format, shape and layout are unchanged. Errors, and values
    that ``keep`` refuses, are not kept."""
    sources = payload_sources(payload)
    attr = f"_qlens_{name}"
    cached = payload.__dict__.get(attr)
    if cached is not None:
        old_sources, fmt, shape, layout, value = cached
        if (
            all(a is b for a, b in zip(old_sources, sources, strict=True))
            and fmt == payload.format
            and shape == tuple(payload.shape)
            and layout == payload.layout
        ):
            return cast(T, value)
    value = build(payload)
    if keep(value):
        payload.__dict__[attr] = (
            sources, payload.format, tuple(payload.shape), dict(payload.layout), value
        )  # fmt: skip
    else:
        payload.__dict__.pop(attr, None)
    return value


def reads_payload_memory(view: KernelWeight | None, payload: QuantPayload) -> bool:
    """Whether every tensor of ``view`` reads the memory of ``payload``'s own tensors (no copy
    was made), so that in-place edits of the payload reach the view."""
    if view is None:
        return True
    storages = {
        t.untyped_storage().data_ptr()
        for t in (payload.data, payload.scales, payload.zeros, payload.global_scale)
        if t is not None
    }
    tensors = (view.data, view.scales, view.zeros, view.global_scale)
    return all(t.untyped_storage().data_ptr() in storages for t in tensors if t is not None)


def kernel_weight(payload: QuantPayload) -> KernelWeight:
    """Check ``payload`` against the qlens layout of its format and return its launch view.

    Raises ``ValueError`` naming what does not match; payloads in other packings should be
    converted first (``qlens.quant.codecs.intgroup.repack_to_qlens``) or dequantized. The view
    is kept on the payload (``cached_on_payload``): the checks cost more host time than a
    decode-step kernel takes on a GPU. A view that had to copy (non-contiguous scales) is
    rebuilt on every call, so in-place edits of the payload always reach the kernels.
    """
    return cached_on_payload(
        payload, "kernel_weight", _checked_view, lambda view: reads_payload_memory(view, payload)
    )


def _checked_view(payload: QuantPayload) -> KernelWeight:
    support = kernel_support(payload.format.name)
    if support is None or support.view is None:
        raise ValueError(
            f"qlens kernels support the formats {fused_kernel_formats()}, not "
            f"{payload.format.name!r}; GGUF Q4_0/Q8_0 map onto them exactly with "
            "qlens.quant.codecs.intgroup.repack_to_qlens, other formats need "
            "qlens.kernels.reference_linear (dequantize, then matmul)"
        )
    return support.view(payload)


def __getattr__(name: str) -> dict[str, int]:
    if name == "FAMILIES":  # each fused-kernel format's family code, read from the codecs
        return kernel_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
