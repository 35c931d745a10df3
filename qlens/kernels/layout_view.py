"""The qlens layouts of the kernel families: their codes and the checked launch view."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlens.quant.codecs.checks import ceil_div
from qlens.quant.payload import QuantPayload

# Format family codes: compile-time constants of the kernels. BNB4: bitsandbytes' 4-bit codes
# (high nibble first) looked up in a 16-entry float32 table (``qlens.kernels.bnb_view``).
FP8_BLOCK, MXFP8, MXFP4, NVFP4, INT4, INT8, BNB4 = range(7)
_PACKED_4BIT = (MXFP4, NVFP4, INT4, BNB4)
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelWeight:
    """A 2-D quantized weight ``W[n, k]`` as the kernels address it.

    ``group_k`` is the number of consecutive K elements sharing one scale and ``group_n`` the rows
    sharing it (128 for block FP8, 1 otherwise). ``code_table``: the float32 values that 4-bit
    codes index (``BNB4`` only; the kernels read it where NVFP4 reads its global scale).
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
    name: str  # the payload's format name
    code_table: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """Two 4-bit codes a byte."""
        return self.family in _PACKED_4BIT


def _expect(cond: bool, payload: QuantPayload, what: str) -> None:
    if not cond:
        raise ValueError(f"qlens kernels cannot read this {payload.format.name} payload: {what}")


def qlens_layout_view(payload: QuantPayload, family: int) -> KernelWeight:
    """Check ``payload`` against the qlens layout of kernel ``family`` and return its launch
    view; raises a ValueError naming what does not match."""
    fmt = payload.format
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
        name=fmt.name,
    )
