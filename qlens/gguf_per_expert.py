"""Mixtral GGUF files written before llama.cpp stacked the experts: each expert of each layer is
its own tensor, ``blk.N.ffn_gate.E.weight`` / ``ffn_up.E.weight`` / ``ffn_down.E.weight`` (w1,
w3, w2 of expert E = 0..experts-1; logical shapes ``[intermediate, hidden]`` for gate and up,
``[hidden, intermediate]`` for down). ``gather_per_expert_tensors`` checks that every expert of a
projection is there, in one GGML type and one shape, and gives each projection as one
``PerExpertTensors``, which ``qlens.gguf_experts.place_experts`` reads like the stacked
``blk.N.ffn_*_exps`` tensor of a current file: expert E's packed bytes become expert E's slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from qlens.load_checks import key_list

PER_EXPERT_TENSOR = re.compile(
    r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)\.(?P<expert>\d+)\.weight"
)
_PARTS = ("gate", "up", "down")
_LAYOUT = (
    "stores its experts one tensor each (blk.N.ffn_{gate,up,down}.E.weight, as llama.cpp wrote "
    "Mixtral files before stacking them into blk.N.ffn_*_exps)"
)
_ONE_TYPE = (
    "qlens stacks one projection's experts into one packed tensor, which holds one type. "
    "Requantize the file so that each projection's experts share a type, or convert the original "
    "checkpoint again with a current llama.cpp."
)
_ONE_SHAPE = (
    "every expert of a projection has the same shape [out, in], so the file is broken: convert "
    "the original checkpoint again."
)


@dataclass(frozen=True)
class PerExpertTensors:
    """One projection's experts of one layer, one gguf-py ``ReaderTensor`` each (expert order),
    with what ``place_experts`` reads of a stacked tensor: ``name`` (for messages),
    ``tensor_type``, ``shape`` (GGML order, experts last) and ``expert_data``."""

    layer: str
    part: str
    tensors: tuple[Any, ...]

    @property
    def name(self) -> str:
        return f"blk.{self.layer}.ffn_{self.part}.{{0..{len(self.tensors) - 1}}}.weight"

    @property
    def stacked_base(self) -> str:
        """The stacked tensor's name in a current file (``blk.N.ffn_gate_exps``)."""
        return f"blk.{self.layer}.ffn_{self.part}_exps"

    @property
    def tensor_type(self) -> Any:
        return self.tensors[0].tensor_type

    @property
    def shape(self) -> np.ndarray:
        return np.array([*self.tensors[0].shape.tolist(), len(self.tensors)])

    @property
    def expert_data(self) -> list[np.ndarray]:
        """Each expert's data as gguf-py maps it from the file (no copy)."""
        return [tensor.data for tensor in self.tensors]


def gather_per_expert_tensors(
    tensors: list[Any], expert_count: int, file_name: str
) -> list[PerExpertTensors]:
    """Group a file's per-expert tensors (names matching ``PER_EXPERT_TENSOR``) by layer and
    projection; raise naming the tensors when an expert is missing or extra, or when one
    projection's experts differ in type or shape."""
    found: dict[tuple[str, str], dict[int, Any]] = {}
    for tensor in tensors:
        match = PER_EXPERT_TENSOR.fullmatch(tensor.name)
        assert match is not None, tensor.name
        found.setdefault((match["layer"], match["part"]), {})[int(match["expert"])] = tensor
    groups = []
    for layer in sorted({layer for layer, _ in found}, key=int):
        for part in _PARTS:
            by_expert = found.get((layer, part), {})
            _require_experts(by_expert, layer, part, expert_count, file_name)
            group = PerExpertTensors(layer, part, tuple(by_expert[e] for e in range(expert_count)))
            _require_one_type_and_shape(group, file_name)
            groups.append(group)
    return groups


def _require_experts(
    by_expert: dict[int, Any], layer: str, part: str, expert_count: int, file_name: str
) -> None:
    numbers = f"E = 0..{expert_count - 1} (llama.expert_count={expert_count})"
    missing = [
        f"blk.{layer}.ffn_{part}.{e}.weight" for e in range(expert_count) if e not in by_expert
    ]
    if missing:
        raise ValueError(
            f"{file_name} lacks {key_list(missing)}: the file {_LAYOUT}, and each layer needs "
            f"all three projections of every expert, {numbers}. The file is incomplete: "
            "download or convert it again."
        )
    extra = sorted(e for e in by_expert if e >= expert_count)
    if extra:
        raise ValueError(
            f"{file_name} holds blk.{layer}.ffn_{part}.{extra[0]}.weight, but its metadata "
            f"numbers the experts {numbers}: the file does not match its own metadata; "
            "convert the original checkpoint again."
        )


def _require_one_type_and_shape(group: PerExpertTensors, file_name: str) -> None:
    types = [tensor.tensor_type.name for tensor in group.tensors]
    shapes = [list(reversed(tensor.shape.tolist())) for tensor in group.tensors]
    for what, values, remedy in (("GGML types", types, _ONE_TYPE), ("shapes", shapes, _ONE_SHAPE)):
        if len({str(value) for value in values}) > 1:
            listed = ", ".join(f"{t.name} {v}" for t, v in zip(group.tensors, values, strict=True))
            raise ValueError(
                f"{file_name}: the experts of {group.stacked_base} are stored one tensor each in "
                f"different {what} ({listed}); {remedy}"
            )
