"""bitsandbytes ``Linear4bit`` (``Params4bit`` + ``QuantState``) and ``Linear8bitLt``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.bnb import BNB_INT8, PACKING, bnb_4bit_format
from qlens.quant.payload import QuantPayload

CPU_BLOCK_N = 32  # row tile of bitsandbytes' CPU GEMM layout


def _from_cpu_gemm_layout(
    packed: torch.Tensor, quant_state: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo bitsandbytes' CPU GEMM repacking (done in place by the first CPU forward on
    AVX512-BF16 machines), without touching the module: returns the standard flattened
    high-nibble-first bytes ``[N*K/2, 1]`` and float32 absmax ``[N*K/blocksize]``.

    In the CPU layout ``[N, K/2]`` each run of 32 bytes holds, for one tile of 32 rows and one
    column pair ``(2j, 2j+1)``, the 64 codes in (row, column) order: the low nibbles the first 32
    (rows 0-15), the high nibbles the last 32 (rows 16-31). The absmax was rounded to bfloat16
    and stored transposed, ``[K/blocksize, N]``; the nested statistics were folded in.
    """
    n, k = (int(s) for s in quant_state.shape)
    if packed.shape != (n, k // 2) or n % CPU_BLOCK_N:
        raise ValueError(
            f"bitsandbytes CPU-packed 4-bit weight must be uint8 [{n}, {k // 2}] with N a "
            f"multiple of {CPU_BLOCK_N}, got {list(packed.shape)}"
        )
    runs = packed.reshape(-1, CPU_BLOCK_N)
    codes = torch.cat([runs & 0xF, runs >> 4], dim=-1)
    codes = codes.reshape(n // CPU_BLOCK_N, k // 2, CPU_BLOCK_N, 2).transpose(1, 2).reshape(-1)
    standard = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).reshape(-1, 1)
    absmax = quant_state.absmax.T.reshape(-1).to(torch.float32)
    return standard, absmax


def payload_from_bnb_4bit(packed: torch.Tensor, quant_state: Any) -> QuantPayload:
    """A ``bnb_nf4``/``bnb_fp4`` payload from bitsandbytes' packed weight and its ``QuantState``."""
    if getattr(quant_state, "packing_format_for_cpu", False):
        standard, absmax = _from_cpu_gemm_layout(packed.view(torch.uint8), quant_state)
        return QuantPayload(
            format=bnb_4bit_format(quant_state.quant_type, int(quant_state.blocksize)),
            data=standard,
            shape=tuple(int(s) for s in quant_state.shape),
            scales=absmax,
            layout={"packing": PACKING, "source": "bitsandbytes-cpu-gemm"},
            extras={"code": quant_state.code.to(torch.float32)},
        )
    if packed.dtype != torch.uint8:  # quant_storage other than uint8 holds the same bytes
        packed = packed.reshape(-1).view(torch.uint8).reshape(-1, 1)
    extras = {"code": quant_state.code.to(torch.float32)}
    layout: dict[str, Any] = {"packing": PACKING}
    if quant_state.nested:
        state2 = quant_state.state2
        extras["nested_absmax"] = state2.absmax
        extras["nested_code"] = state2.code
        extras["nested_offset"] = torch.as_tensor(quant_state.offset, dtype=torch.float32).reshape(
            ()
        )
        layout["nested_blocksize"] = int(state2.blocksize)
    return QuantPayload(
        format=bnb_4bit_format(quant_state.quant_type, int(quant_state.blocksize)),
        data=packed,
        shape=tuple(int(s) for s in quant_state.shape),
        scales=quant_state.absmax,
        layout=layout,
        extras=extras,
    )


def _is_linear4bit(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return getattr(weight, "quant_state", None) is not None


def int8_row_scales(module: nn.Module) -> torch.Tensor | None:
    """The row scales (``SCB``) of a bitsandbytes int8 linear, wherever bitsandbytes keeps them.

    ``Int8Params.SCB`` holds them until the module's first forward, which moves them to
    ``module.state.SCB`` and sets the weight's to None.
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8:
        return None
    for holder in (weight, getattr(module, "state", None)):
        scb = getattr(holder, "SCB", None)
        if isinstance(scb, torch.Tensor):
            return scb
    return None


def _is_linear8bit(module: nn.Module) -> bool:
    return int8_row_scales(module) is not None


@register_adopter("bitsandbytes Linear4bit (Params4bit with quant_state)", _is_linear4bit)
def adopt_linear4bit(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    return payload_from_bnb_4bit(weight.data, weight.quant_state)


@register_adopter(
    "bitsandbytes Linear8bitLt (Int8Params with SCB, before or after its first forward)",
    _is_linear8bit,
)
def adopt_linear8bit(module: nn.Module) -> QuantPayload:
    weight: Any = module.weight
    return QuantPayload(
        format=BNB_INT8,
        data=weight.data,
        shape=tuple(weight.shape),
        scales=int8_row_scales(module),
        layout={"packing": PACKING},
    )
