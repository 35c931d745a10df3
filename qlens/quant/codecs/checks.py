"""Validation of payload tensors: every failure names the tensor, what was expected and the fix."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from qlens.quant.payload import QuantPayload


def _label(payload: QuantPayload | None, name: str) -> str:
    return f"{payload.format.name} payload `{name}`" if payload is not None else f"`{name}`"


def require_tensor(
    value: Tensor | None, name: str, payload: QuantPayload | None = None, fix: str = ""
) -> Tensor:
    """``value`` itself, or a ValueError saying the tensor is missing."""
    if value is None:
        raise ValueError(f"{_label(payload, name)} is missing (None); {fix or 'provide it'}")
    return value


def require_dtype(
    t: Tensor,
    name: str,
    allowed: Sequence[torch.dtype],
    payload: QuantPayload | None = None,
    fix: str = "",
) -> None:
    """Raise unless ``t.dtype`` is one of ``allowed``."""
    if t.dtype not in allowed:
        expected = " or ".join(str(d) for d in allowed)
        hint = fix or f"convert it with .to({allowed[0]}) or .view({allowed[0]}) as appropriate"
        raise ValueError(f"{_label(payload, name)} must be {expected}, got {t.dtype}; {hint}")


def require_shape(
    t: Tensor,
    name: str,
    expected: Sequence[int],
    payload: QuantPayload | None = None,
    fix: str = "",
) -> None:
    """Raise unless ``t.shape`` equals ``expected``."""
    if tuple(t.shape) != tuple(expected):
        hint = fix or "check that the tensor belongs to this weight and its layout"
        raise ValueError(
            f"{_label(payload, name)} must have shape {list(expected)}, got {list(t.shape)}; {hint}"
        )


def require_contiguous(t: Tensor, name: str, payload: QuantPayload | None = None) -> None:
    """Packed data is read by byte offsets, so a strided view would be decoded wrongly."""
    if not t.is_contiguous():
        raise ValueError(
            f"{_label(payload, name)} must be contiguous (packed data is addressed by offset), "
            f"got strides {list(t.stride())} for shape {list(t.shape)}; call .contiguous() first"
        )


def require_finite(t: Tensor, name: str, payload: QuantPayload | None = None) -> None:
    """Raise if a scale tensor holds NaN or infinity."""
    values = t.float()
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{_label(payload, name)} must be finite, but {int(bad.sum())} entries are NaN or "
            f"infinite (first at index {first}: {values[tuple(first)].item()}); the checkpoint or "
            "the quantizer that produced it is corrupt, re-quantize the weight"
        )


def require_e8m0_not_nan(
    scale_bytes: Tensor, name: str, payload: QuantPayload | None = None
) -> None:
    """E8M0 byte 255 encodes NaN: no valid weight block can have it."""
    bad = scale_bytes == 255
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{_label(payload, name)} holds {int(bad.sum())} E8M0 NaN bytes (255), first at "
            f"index {first}; expected exponent bytes 0..254 (2**(b-127)); the scales are corrupt "
            "or are not E8M0 (fp32 scales must use scale_dtype='fp32')"
        )


def require_same_device(payload: QuantPayload) -> None:
    """Every tensor of a payload must live on the data's device."""
    for name, t in payload.tensors().items():
        if t.device != payload.data.device:
            raise ValueError(
                f"{_label(payload, name)} is on {t.device} but `data` is on "
                f"{payload.data.device}; move the whole payload with payload.to(device)"
            )


def require_layout(payload: QuantPayload, key: str, allowed: Sequence[object]) -> object:
    """The layout flag ``key`` (default first of ``allowed``), checked against ``allowed``."""
    value = payload.layout.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(
            f"{payload.format.name} payload layout[{key!r}] must be one of {list(allowed)}, "
            f"got {value!r}"
        )
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def weight_dims(payload: QuantPayload) -> tuple[tuple[int, ...], int, int]:
    """``(expert_dims, N, K)`` of a payload's logical ``[*e, N, K]`` shape."""
    if len(payload.shape) < 2:
        raise ValueError(
            f"{payload.format.name} payload shape must be [out, in] or [experts, out, in], "
            f"got {list(payload.shape)}"
        )
    *lead, n, k = (int(s) for s in payload.shape)
    return tuple(lead), n, k


def check_scales(
    payload: QuantPayload, expected_shape: Sequence[int], dtypes: Sequence[torch.dtype]
) -> Tensor:
    """The payload's scales after checking presence, dtype, shape and finiteness."""
    scales = require_tensor(payload.scales, "scales", payload)
    require_dtype(scales, "scales", dtypes, payload)
    require_shape(scales, "scales", expected_shape, payload)
    if scales.dtype in (torch.uint8, torch.float8_e8m0fnu):
        require_e8m0_not_nan(scales.view(torch.uint8), "scales", payload)
    else:
        require_finite(scales, "scales", payload)
    return scales
