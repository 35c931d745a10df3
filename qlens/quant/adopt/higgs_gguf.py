"""HIGGS (``HiggsLinear``) and GGUF (``GgufLinear``/``GgufEmbedding``/``GgufExperts``) modules.

They are recognised by their attributes, not their classes: transformers only creates them when
FLUTE (CUDA) or a GGUF kernel is available, and other libraries use the same fields.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.gguf import (
    GGML_TYPES,
    ggml_type_by_id,
    gguf_format,
)
from qlens.quant.codecs.gguf import (
    PACKING as GGUF_PACKING,
)
from qlens.quant.codecs.higgs import PACKING as HIGGS_PACKING
from qlens.quant.codecs.higgs import flute_tile_p, higgs_format
from qlens.quant.payload import QuantPayload


def _is_higgs(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.int16
        and isinstance(getattr(module, "tables2", None), torch.Tensor)
        and isinstance(getattr(module, "hadamard_size", None), int)
    )


@register_adopter(
    "HIGGS HiggsLinear (FLUTE int16 weight, scales, tables2, tune_metadata)", _is_higgs
)
def adopt_higgs(module: nn.Module) -> QuantPayload:
    m: Any = module
    metadata = getattr(m, "tune_metadata", None)
    template_id = getattr(metadata, "template_id", None)
    if template_id is None:
        raise ValueError(
            f"{type(module).__name__} has no tune_metadata.template_id: the FLUTE packing (TileP) "
            "of its weight is unknown until transformers sets it after loading"
        )
    bits = int(m.num_bits)
    return QuantPayload(
        format=higgs_format(bits, int(m.group_size), m.scales.dtype),
        data=m.weight.detach(),
        shape=(int(m.out_features), int(m.in_features)),
        scales=m.scales.detach(),
        layout={
            "packing": HIGGS_PACKING,
            "tile_p": flute_tile_p(bits, int(template_id)),
            "hadamard_size": int(m.hadamard_size),
        },
        extras={"tables2": m.tables2.detach()},
    )


def _is_gguf(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    ggml_type = getattr(module, "ggml_type", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.uint8
        and isinstance(ggml_type, int)
        and not isinstance(ggml_type, bool)
    )


def gguf_payload(blocks: torch.Tensor, type_id: int) -> QuantPayload:
    """Payload of raw GGML blocks ``uint8 [..., row_bytes]`` of GGML type ``type_id``."""
    ggml_type = ggml_type_by_id(type_id)
    if blocks.shape[-1] % ggml_type.type_size:
        raise ValueError(
            f"GGUF {ggml_type.name} weight rows must be whole {ggml_type.type_size}-byte blocks, "
            f"got shape {list(blocks.shape)}"
        )
    cols = blocks.shape[-1] // ggml_type.type_size * ggml_type.block_size
    return QuantPayload(
        format=gguf_format(ggml_type),
        data=blocks,
        shape=(*blocks.shape[:-1], cols),
        layout={"packing": GGUF_PACKING, "ggml_type": ggml_type.type_id},
    )


@register_adopter(
    f"GGUF GgufLinear / GgufEmbedding (uint8 [N, row_bytes] + ggml_type in {sorted(GGML_TYPES)})",
    _is_gguf,
)
def adopt_gguf(module: nn.Module) -> QuantPayload:
    m: Any = module
    payload = gguf_payload(m.weight.detach(), int(m.ggml_type))
    perm = getattr(m, "input_permutation", None)
    if isinstance(perm, torch.Tensor):
        payload.extras["input_permutation"] = perm.detach().to(torch.int64)
    return payload


def _is_gguf_experts(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, f"{p}_proj", None), torch.Tensor)
        and getattr(module, f"{p}_proj").dtype == torch.uint8
        and isinstance(getattr(module, f"{p}_type", None), int)
        for p in ("gate_up", "down")
    )


@register_adopter(
    "GGUF GgufExperts (uint8 gate_up_proj/down_proj blocks + gate_up_type/down_type)",
    _is_gguf_experts,
)
def adopt_gguf_experts(module: nn.Module) -> dict[str, QuantPayload]:
    m: Any = module
    gate_up = gguf_payload(m.gate_up_proj.detach(), int(m.gate_up_type))
    gate_up.layout["gate_up"] = "stacked"  # GgufExperts splits its output with chunk(2)
    return {
        "gate_up_proj": gate_up,
        "down_proj": gguf_payload(m.down_proj.detach(), int(m.down_type)),
    }
