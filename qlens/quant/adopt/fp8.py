"""transformers fine-grained FP8: ``FP8Linear``, ``FP8Embedding`` and ``FP8Experts``
(stacked gate|up; FP8 or FP4 experts)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.fp8 import E8M0_DTYPES, validate_fp8_block
from qlens.quant.codecs.mx import pack_mx
from qlens.quant.formats import fp8_block_format
from qlens.quant.payload import QuantPayload

SOURCE = "transformers-fp8"


def _is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn


def fp8_payload(weight: torch.Tensor, scale_inv: torch.Tensor, block: Any) -> QuantPayload:
    """``fp8_block`` payload of an e4m3 ``[*e, N, K]`` weight and its ``weight_scale_inv``.

    ``block`` is the config's ``weight_block_size`` (None = one per-tensor scale). The scale grid
    is ceil-divided from it, never inferred from the grid's shape.
    """
    *lead, n, k = weight.shape
    if block is None:
        if scale_inv.numel() != 1 and tuple(scale_inv.shape) != tuple(lead):
            raise ValueError(
                "a per-tensor FP8 weight (block_size None) needs one scale (per expert), got "
                f"weight_scale_inv {list(scale_inv.shape)}"
            )
        block = (n, k)
        scale_inv = scale_inv.reshape(*lead, 1, 1)
    e8m0 = scale_inv.dtype in E8M0_DTYPES
    payload = QuantPayload(
        format=fp8_block_format((int(block[0]), int(block[1])), "e8m0" if e8m0 else "fp32"),
        data=weight,
        shape=tuple(weight.shape),
        scales=scale_inv.view(torch.uint8) if e8m0 else scale_inv,
        layout={"packing": "qlens", "source": SOURCE},
    )
    validate_fp8_block(payload)
    return payload


def _is_fp8_linear(module: nn.Module) -> bool:
    return _is_fp8(getattr(module, "weight", None)) and isinstance(
        getattr(module, "weight_scale_inv", None), torch.Tensor
    )


@register_adopter("transformers FP8Linear (e4m3 weight + weight_scale_inv)", _is_fp8_linear)
def adopt_fp8_linear(module: nn.Module) -> QuantPayload:
    m: Any = module
    return fp8_payload(m.weight.detach(), m.weight_scale_inv.detach(), m.block_size)


def fp4_expert_payload(weight: torch.Tensor, scale: torch.Tensor) -> QuantPayload:
    """MXFP4 payload of FP4 experts (``expert_dtype="fp4"``): int8 ``[E, N, K/2]`` low nibble first,
    one scale per 32 along K, e8m0 or fp32 (then it must be an exact power of two)."""
    if scale.dtype in E8M0_DTYPES:
        scale_bytes = scale.view(torch.uint8)
    else:
        mantissa, exponent = torch.frexp(scale.float())
        if not bool((mantissa == 0.5).all()):
            raise NotImplementedError(
                "FP4 expert scales in fp32 that are not exact powers of two have no MXFP4 (E8M0) "
                "equivalent; dequantize the checkpoint instead"
            )
        scale_bytes = (exponent - 1 + 127).clamp(0, 254).to(torch.uint8)
    *lead, n, half = weight.shape
    payload = pack_mx(weight.view(torch.uint8), scale_bytes, (*lead, n, 2 * half))
    payload.layout["source"] = SOURCE
    return payload


def _expert_payload(weight: torch.Tensor, scale: torch.Tensor, block: Any) -> QuantPayload:
    if weight.dtype == torch.int8:
        return fp4_expert_payload(weight, scale)
    return fp8_payload(weight, scale, block)


def _is_fp8_experts(module: nn.Module) -> bool:
    down = getattr(module, "down_proj", None)
    quantized = _is_fp8(down) or (isinstance(down, torch.Tensor) and down.dtype == torch.int8)
    return quantized and isinstance(getattr(module, "down_proj_scale_inv", None), torch.Tensor)


@register_adopter(
    "transformers FP8Experts (e4m3 gate_up_proj/down_proj + *_scale_inv)", _is_fp8_experts
)
def adopt_fp8_experts(module: nn.Module) -> dict[str, QuantPayload]:
    m: Any = module
    block = m.block_size
    if not getattr(m, "has_gate", True):
        raise NotImplementedError(
            "FP8Experts without a gate (up_proj only) is not adopted: qlens' experts need gate|up"
        )
    gate_up = m.gate_up_proj.detach()
    scale = m.gate_up_proj_scale_inv.detach()
    half = gate_up.shape[-2] // 2
    if gate_up.dtype != torch.int8 and block is not None and half % int(block[0]):
        # Gate and up are quantized as separate tensors, each on its own ceil-div grid, and
        # transformers keeps at least 2 scale rows. With I < block rows that is one row per half,
        # i.e. a uniform grid of block rows I; any other ragged I has no uniform grid.
        if half > int(block[0]) or scale.shape[-2] != 2:
            raise NotImplementedError(
                f"FP8Experts with intermediate size {half} not a multiple of the block rows "
                f"{block[0]} has per-half scale grids that no single block grid expresses; "
                "dequantize the checkpoint's gate and up projections separately"
            )
        block = (half, int(block[1]))
    payload = _expert_payload(gate_up, scale, block)
    payload.layout["gate_up"] = "stacked"
    down = _expert_payload(m.down_proj.detach(), m.down_proj_scale_inv.detach(), m.block_size)
    return {"gate_up_proj": payload, "down_proj": down}


def _is_fp8_embedding(module: nn.Module) -> bool:
    return (
        type(module).__name__ == "FP8Embedding"
        and _is_fp8(getattr(module, "weight", None))
        and isinstance(getattr(module, "weight_scale", None), torch.Tensor)
    )


@register_adopter(
    "transformers FP8Embedding (e4m3 weight + per-tensor weight_scale)", _is_fp8_embedding
)
def adopt_fp8_embedding(module: nn.Module) -> QuantPayload:
    m: Any = module
    return fp8_payload(m.weight.detach(), m.weight_scale.detach(), None)
