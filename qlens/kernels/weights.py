"""The weight payloads the Triton kernels read, checked and reduced to launch arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from qlens.quant.codecs.checks import ceil_div
from qlens.quant.payload import QuantPayload

T = TypeVar("T")

# Format family codes: compile-time constants of the kernels.
FP8_BLOCK, MXFP8, MXFP4, NVFP4, INT4, INT8 = range(6)
FAMILIES = {
    "fp8_block": FP8_BLOCK,
    "mxfp8": MXFP8,
    "mxfp4": MXFP4,
    "nvfp4": NVFP4,
    "int4": INT4,
    "int8": INT8,
}
_PACKED_4BIT = (MXFP4, NVFP4, INT4)
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelWeight:
    """A 2-D quantized weight ``W[n, k]`` as the kernels address it.

    ``group_k`` is the number of consecutive K elements sharing one scale and ``group_n`` the rows
    sharing it (128 for block FP8, 1 otherwise).
    """

    family: int
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    global_scale: torch.Tensor | None
    group_n: int
    group_k: int
    scale_e8m0: bool
    global_divide: bool

    @property
    def name(self) -> str:
        return next(name for name, code in FAMILIES.items() if code == self.family)

    @property
    def packed(self) -> bool:
        """Two 4-bit codes a byte."""
        return self.family in _PACKED_4BIT


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


def _expect(cond: bool, payload: QuantPayload, what: str) -> None:
    if not cond:
        raise ValueError(f"qlens kernels cannot read this {payload.format.name} payload: {what}")


def cached_on_payload(
    payload: QuantPayload,
    name: str,
    build: Callable[[QuantPayload], T],
    keep: Callable[[T], bool] = lambda value: True,
) -> T:
    """``build(payload)``, kept on the payload under ``name`` and returned again while its tensors
    are the same objects and its format, shape and layout are unchanged. Errors, and values
    that ``keep`` refuses, are not kept."""
    sources = (payload.data, payload.scales, payload.zeros, payload.global_scale)
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
    fmt = payload.format
    if fmt.name not in FAMILIES:
        raise ValueError(
            f"qlens kernels support the formats {sorted(FAMILIES)}, not {fmt.name!r}; "
            "GGUF Q4_0/Q8_0 map onto them exactly with "
            "qlens.quant.codecs.intgroup.repack_to_qlens, other formats need "
            "qlens.kernels.reference_linear (dequantize, then matmul)"
        )
    family = FAMILIES[fmt.name]
    packing = payload.layout.get("packing", "qlens")
    _expect(
        packing == "qlens",
        payload,
        f"layout packing is {packing!r}, the kernels read only the 'qlens' packing; repack it "
        "(qlens.quant.codecs.intgroup.repack_to_qlens) or use qlens.kernels.reference_linear",
    )
    _expect(
        len(payload.shape) == 2,
        payload,
        f"logical shape {list(payload.shape)} is not a 2-D [out, in] linear weight",
    )
    swizzle = payload.layout.get("scale_swizzle", "none")
    _expect(swizzle == "none", payload, f"scale_swizzle {swizzle!r} is not supported (need 'none')")
    n, k = (int(s) for s in payload.shape)
    scales = payload.scales
    if scales is None:
        raise ValueError(f"qlens kernels cannot read this {fmt.name} payload: scales are missing")
    data = payload.data
    group_n, group_k = (int(b) for b in fmt.block)
    if family in _PACKED_4BIT:
        width = ceil_div(k, group_k) * group_k // 2 if family != INT4 else ceil_div(k, 2)
        _expect(data.dtype == torch.uint8, payload, f"data must be uint8, got {data.dtype}")
        _expect(
            tuple(data.shape) == (n, width),
            payload,
            f"data must have shape {[n, width]} (two 4-bit codes per byte), got {list(data.shape)}",
        )
    else:
        want = torch.int8 if family == INT8 else torch.float8_e4m3fn
        _expect(data.dtype == want, payload, f"data must be {want}, got {data.dtype}")
        _expect(
            tuple(data.shape) == (n, k),
            payload,
            f"data must have shape {[n, k]}, got {list(data.shape)}",
        )
    _expect(data.is_contiguous(), payload, "data must be contiguous; call .contiguous() first")
    if family != FP8_BLOCK:
        _expect(group_n == 1, payload, f"block {fmt.block} must have one row per scale")
    scale_rows = ceil_div(n, group_n)
    _expect(
        tuple(scales.shape) == (scale_rows, ceil_div(k, group_k)),
        payload,
        f"scales must have shape {[scale_rows, ceil_div(k, group_k)]} for block {fmt.block}, "
        f"got {list(scales.shape)}",
    )
    scale_e8m0 = family in (MXFP8, MXFP4) or fmt.scale_dtype == "e8m0"
    if scale_e8m0:
        if scales.dtype == torch.float8_e8m0fnu:
            scales = scales.view(torch.uint8)
        _expect(
            scales.dtype == torch.uint8, payload, f"E8M0 scales must be uint8, got {scales.dtype}"
        )
    elif family == NVFP4:
        _expect(
            scales.dtype == torch.float8_e4m3fn,
            payload,
            f"scales must be float8_e4m3fn, got {scales.dtype}",
        )
    else:
        _expect(
            scales.dtype in _FLOAT_SCALES,
            payload,
            f"scales must be one of {list(_FLOAT_SCALES)}, got {scales.dtype}",
        )
    _expect(
        group_k % 16 == 0 and group_k & (group_k - 1) == 0,
        payload,
        f"the scale group along K ({group_k}) must be a power of two of at least 16",
    )
    zeros = payload.zeros
    if zeros is not None:
        _expect(family in (INT4, INT8), payload, "zero points are only read for int4/int8")
        want = torch.uint8 if family == INT4 else torch.int8
        _expect(zeros.dtype == want, payload, f"zeros must be {want}, got {zeros.dtype}")
        _expect(
            zeros.shape == scales.shape,
            payload,
            f"zeros must match the scales' shape {list(scales.shape)}, got {list(zeros.shape)}",
        )
    global_scale = payload.global_scale
    if family == NVFP4:
        if global_scale is None:
            raise ValueError(
                f"qlens kernels cannot read this {fmt.name} payload: the fp32 global_scale is missing"
            )
        _expect(
            global_scale.numel() == 1 and global_scale.dtype == torch.float32,
            payload,
            f"global_scale must be one float32 value, got {global_scale.dtype}"
            f"{list(global_scale.shape)}",
        )
        _expect(
            fmt.global_scale in ("multiply", "divide"),
            payload,
            f"global_scale convention must be 'multiply' or 'divide', got {fmt.global_scale!r}",
        )
    return KernelWeight(
        family=family,
        n=n,
        k=k,
        data=data,
        scales=scales.contiguous(),
        zeros=None if zeros is None else zeros.contiguous(),
        global_scale=None if global_scale is None else global_scale.reshape(1),
        group_n=group_n,
        group_k=group_k,
        scale_e8m0=scale_e8m0,
        global_divide=fmt.global_scale == "divide",
    )
