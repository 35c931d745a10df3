"""A GGUF file's stacked expert tensors placed in the model as qlens ``QuantExperts``.

llama.cpp writes each MoE layer's routed experts as three tensors ``blk.N.ffn_gate_exps`` /
``ffn_up_exps`` / ``ffn_down_exps`` of logical shape ``[experts, out, in]``. transformers'
``Qwen2MoeTensorProcessor`` (qwen2moe, qwen3moe) stacks gate above up per expert into the fused
module's ``gate_up_proj [experts, 2 * intermediate, hidden]`` and takes down as ``down_proj
[experts, hidden, intermediate]``. GGML blocks run along the input dim, so stacking rows stacks
whole rows of blocks: qlens concatenates the packed gate and up rows the same way and keeps
them as GGUF payloads. Experts whose gate and up differ in type, or of a type qlens has no codec
for, are dequantized by gguf-py exactly as transformers does (and logged). Older Mixtral files
store one tensor per expert; ``qlens.gguf_per_expert`` gathers them into the same stacked form.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch
from torch import nn

from qlens.gguf_per_expert import PerExpertTensors

logger = logging.getLogger(__name__)

EXPERT_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight")
PARTS = ("gate", "up", "down")
FLOAT_TYPES = {0, 1, 30}  # GGML F32, F16, BF16: float in the file already
# The config fields holding the expert count and width, named when shapes disagree.
MOE_SIZE_NAMES = ("num_experts", "moe_intermediate_size")


def expert_tensor_base(name: str) -> str | None:
    """``blk.N.ffn_gate_exps`` for ``blk.N.ffn_gate_exps.weight`` (the key transformers' name
    map uses for stacked experts), ``None`` for any other tensor."""
    match = EXPERT_TENSOR.fullmatch(name)
    return None if match is None else name.removesuffix(".weight")


def _layer_and_part(tensor: Any) -> tuple[str, str]:
    if isinstance(tensor, PerExpertTensors):
        return tensor.layer, tensor.part
    match = EXPERT_TENSOR.fullmatch(tensor.name)
    assert match is not None, tensor.name
    return match["layer"], match["part"]


def _expert_data(tensor: Any) -> list[np.ndarray]:
    """Each expert's data, as gguf-py maps it from the file: views along a stacked tensor's first
    axis, or the tensors of a ``PerExpertTensors``."""
    return tensor.expert_data if isinstance(tensor, PerExpertTensors) else list(tensor.data)


def _logical_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in reversed(tensor.shape.tolist()))


def place_experts(
    model: nn.Module,
    module_name: str,
    tensors: list[Any],
    *,
    activation: str,
    dtype: torch.dtype,
    file_name: str,
    size_names: tuple[str, str] = MOE_SIZE_NAMES,
) -> None:
    """Put one layer's expert tensors (gguf-py ``ReaderTensor``s of stacked experts, or
    ``PerExpertTensors``) at ``module_name``: a ``QuantExperts`` over GGUF payloads, or the float
    weights where they cannot stay packed. ``size_names``: the config's expert count and width
    fields, named when the shapes disagree."""
    from qlens.quant.codecs.gguf import GGML_TYPES

    by_part = {_layer_and_part(t)[1]: t for t in tensors}
    if len(by_part) < len(tensors):
        raise ValueError(
            f"{file_name} holds the experts of {module_name} twice, stacked and one tensor per "
            f"expert ({', '.join(t.name for t in tensors)}); a file stores each layer's experts "
            "one way. Convert the original checkpoint again."
        )
    missing = [p for p in PARTS if p not in by_part]
    if missing:
        layer, _ = _layer_and_part(tensors[0])
        names = ", ".join(f"blk.{layer}.ffn_{p}_exps.weight" for p in missing)
        raise ValueError(f"{file_name} lacks {names} (the layer's other expert tensors are there)")
    _check_shapes(model, module_name, by_part, file_name, size_names)
    types = {part: int(t.tensor_type) for part, t in by_part.items()}
    if types["gate"] == types["up"] and all(t in GGML_TYPES for t in types.values()):
        model.set_submodule(module_name, _packed_experts(by_part, types, activation))
        return
    if not set(types.values()) <= FLOAT_TYPES:
        logger.warning(
            "%s: %s are %s; qlens keeps experts packed only when gate and up share a type it has "
            "a codec for, so gguf-py dequantizes them to %s",
            file_name,
            module_name,
            ", ".join(f"{by_part[p].name} {by_part[p].tensor_type.name}" for p in PARTS),
            dtype,
        )
    _put_float_experts(model, module_name, by_part, dtype)


def _check_shapes(
    model: nn.Module,
    module_name: str,
    by_part: dict[str, Any],
    file_name: str,
    size_names: tuple[str, str],
) -> None:
    """Raise naming the first expert tensor whose shape the model's experts module does not take."""
    gate_up_shape = model.get_submodule(module_name).get_parameter("gate_up_proj").shape
    num_experts, two_i, hidden = (int(s) for s in gate_up_shape)
    intermediate = two_i // 2
    expected = {
        "gate": (num_experts, intermediate, hidden),
        "up": (num_experts, intermediate, hidden),
        "down": (num_experts, hidden, intermediate),
    }
    for part in PARTS:
        tensor = by_part[part]
        shape = _logical_shape(tensor)
        if shape == expected[part]:
            continue
        raise ValueError(
            f"{file_name}: {tensor.name} has shape {list(shape)} [experts, out, in], but the model "
            f"built from the file's config expects {list(expected[part])} at {module_name} "
            f"({size_names[0]}={num_experts}, {size_names[1]}={intermediate}, "
            f"hidden_size={hidden}): the file does not match its own metadata"
        )


def _packed_experts(by_part: dict[str, Any], types: dict[str, int], activation: str) -> nn.Module:
    from qlens.modules import ExpertGate, QuantExperts
    from qlens.quant.adopt.higgs_gguf import gguf_payload

    # One copy out of the file each: uint8 [experts, rows, row_bytes], gate rows above up rows.
    gate, up, down_data = (_expert_data(by_part[part]) for part in PARTS)
    rows, row_bytes = gate[0].shape
    gate_up_blocks = np.empty((len(gate), rows + up[0].shape[0], row_bytes), gate[0].dtype)
    for expert, (gate_blocks, up_blocks) in enumerate(zip(gate, up, strict=True)):
        gate_up_blocks[expert, :rows] = gate_blocks
        gate_up_blocks[expert, rows:] = up_blocks
    gate_up = gguf_payload(torch.from_numpy(gate_up_blocks), types["gate"])
    gate_up.layout["gate_up"] = "stacked"
    down = gguf_payload(torch.from_numpy(np.stack(down_data)), types["down"])
    return QuantExperts(gate_up, down, ExpertGate("stacked", activation))


def _put_float_experts(
    model: nn.Module, module_name: str, by_part: dict[str, Any], dtype: torch.dtype
) -> None:
    from gguf import dequantize as gguf_dequantize

    from qlens.quantize_on_load import put_tensor

    def values(part: str) -> np.ndarray:
        tensor = by_part[part]
        return np.stack([gguf_dequantize(d, tensor.tensor_type) for d in _expert_data(tensor)])

    gate_up = np.concatenate([values("gate"), values("up")], axis=1)
    put_tensor(model, f"{module_name}.gate_up_proj", torch.from_numpy(gate_up).to(dtype))
    put_tensor(model, f"{module_name}.down_proj", torch.from_numpy(values("down")).to(dtype))
