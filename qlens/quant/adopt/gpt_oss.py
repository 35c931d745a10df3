"""GPT-OSS MXFP4 experts: checkpoint-layout ``*_blocks``/``*_scales`` buffers, or the GPU module
whose projections are triton_kernels tensor wrappers (read by duck typing, never imported).

Both become MXFP4 payloads in logical ``[E, out, in]`` orientation; gate|up rows are interleaved
(``[g0, u0, g1, u1, ...]``). The dequantized bf16 ``GptOssExperts`` (CPU load) is not quantized.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.mx import mxfp4_from_gpt_oss
from qlens.quant.payload import QuantPayload

PROJECTIONS = ("gate_up_proj", "down_proj")


def _has_buffers(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, f"{p}_{kind}", None), torch.Tensor)
        for p in PROJECTIONS
        for kind in ("blocks", "scales")
    )


def _storage_of(value: Any) -> Any:
    storage = getattr(value, "storage", None)
    data = getattr(storage, "data", None)
    layout = getattr(storage, "layout", None)
    if isinstance(data, torch.Tensor) and callable(getattr(layout, "unswizzle_data", None)):
        return storage
    return None


def _has_wrappers(module: nn.Module) -> bool:
    for p in PROJECTIONS:
        value = getattr(module, p, None)
        config = getattr(module, f"{p}_precision_config", None)
        if isinstance(value, torch.Tensor) or _storage_of(value) is None:
            return False
        if _storage_of(getattr(config, "weight_scale", None)) is None:
            return False
    return True


def gpt_oss_payload(blocks: torch.Tensor, scales: torch.Tensor, projection: str) -> QuantPayload:
    """MXFP4 payload ``[E, out, in]`` of one projection's checkpoint ``*_blocks`` / ``*_scales``."""
    payload = mxfp4_from_gpt_oss(blocks, scales)
    payload.layout["source"] = "gpt-oss"
    if projection == "gate_up_proj":
        payload.layout["gate_up"] = "interleaved"
    return payload


@register_adopter("GPT-OSS experts holding *_blocks / *_scales MXFP4 buffers", _has_buffers)
def adopt_gpt_oss_buffers(module: nn.Module) -> dict[str, QuantPayload]:
    return {
        p: gpt_oss_payload(getattr(module, f"{p}_blocks"), getattr(module, f"{p}_scales"), p)
        for p in PROJECTIONS
    }


def _unswizzled(value: Any) -> torch.Tensor:
    """triton_kernels tensor -> torch data in checkpoint orientation (last two dims swapped)."""
    storage = _storage_of(value)
    return storage.layout.unswizzle_data(storage.data).transpose(-1, -2)


@register_adopter(
    "GPT-OSS Mxfp4GptOssExperts (triton_kernels tensors with .storage.data/.storage.layout)",
    _has_wrappers,
)
def adopt_gpt_oss_wrappers(module: nn.Module) -> dict[str, QuantPayload]:
    payloads = {}
    for p in PROJECTIONS:
        scales = _unswizzled(getattr(module, f"{p}_precision_config").weight_scale)
        blocks = _unswizzled(getattr(module, p))
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(
                f"GPT-OSS {p}: expected uint8 MXFP4 storage and uint8 E8M0 scales, got "
                f"{blocks.dtype} and {scales.dtype}"
            )
        if blocks.shape[:-1] != scales.shape[:-1] or blocks.shape[-1] != 16 * scales.shape[-1]:
            raise ValueError(
                f"GPT-OSS {p}: unswizzled data {list(blocks.shape)} does not hold 16 bytes per "
                f"scale of {list(scales.shape)}; is the layout's unswizzle_data correct?"
            )
        payloads[p] = gpt_oss_payload(blocks.reshape(*scales.shape, 16), scales, p)
    return payloads
