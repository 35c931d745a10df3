"""Copy a bridged model for weight processing, materializing quantized weights only on opt-in."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qlens.quant.guards import require_readable_weight, weight_problem
from qlens.weights.access import (
    dequantize_opted_in,
    method_owner,
    read_optional,
    read_tensor,
    read_weight,
)
from qlens.weights.float_experts import float_experts, float_experts_bytes, is_experts_module
from qlens.weights.storage import (
    UnreadableWeight,
    float_dtype,
    replace_tensor,
    unreadable_weights,
    write_tensor,
    write_weight,
)

logger = logging.getLogger(__name__)


@dataclass
class ProcessingSummary:
    """What weight processing did: its steps and the quantized weights it materialized in float."""

    steps: list[str] = field(default_factory=list)
    materialized: dict[str, int] = field(default_factory=dict)  # module or weight -> bytes
    dtype: str = "float32"

    @property
    def materialized_bytes(self) -> int:
        return sum(self.materialized.values())

    def __str__(self) -> str:
        lines = [f"steps: {', '.join(self.steps) or 'none'}"]
        if self.materialized:
            lines.append(
                f"materialized {len(self.materialized)} quantized weights as {self.dtype}: "
                f"{self.materialized_bytes / 2**20:.2f} MiB"
            )
            lines += [f"  {name}: {n / 2**20:.3f} MiB" for name, n in self.materialized.items()]
        return "\n".join(lines)


@dataclass
class Processed:
    """A processed bridge (over a processed model) and the summary of what was done."""

    bridge: Any
    summary: ProcessingSummary


def prepare(
    bridge: Any,
    operation: str,
    *,
    dequantize: bool,
    inplace: bool,
    dtype: torch.dtype | None = None,
) -> Processed:
    """The bridge to process (a deep copy unless ``inplace``) with every weight readable.

    Scans all weights of the model (every parameter, 3-D experts, quantized modules). Any
    unreadable one raises through the guard unless ``dequantize`` (or a ``dequantized(bridge)``
    block); then quantized linear layers are replaced by float ``nn.Linear``, quantized experts
    modules by float experts modules of the model's HF class and quantized parameters by float
    ones, announced in the log with their memory and listed in the summary. They are rebuilt in
    ``dtype`` (default: the dtype of the model's readable float parameters).
    """
    dequantize = dequantize_opted_in(bridge, dequantize)
    found = unreadable_weights(bridge.model)
    # Meta, uninitialized, complex...: dequantization cannot fix these, so they refuse first.
    unfixable = [f for f in found if not _fixed_by_dequantization(f.value)]
    if found and (not dequantize or unfixable):
        first = (unfixable or found)[0]
        others = f" ({len(found)} unreadable weights in all, first: {first.name})"
        require_readable_weight(
            first.value,
            operation=operation + others,
            owner=method_owner(first.module, bridge.model),
        )
    dtype = dtype or float_dtype(bridge.model)
    planned = {item.name: _planned_bytes(item, dtype, operation) for item in found}
    if planned:
        logger.warning(
            "%s: as opted in, materializing %d quantized weights as %s (%.2f MiB): %s",
            operation,
            len(planned),
            str(dtype).removeprefix("torch."),
            sum(planned.values()) / 2**20,
            ", ".join(planned),
        )
    model = bridge.model if inplace else copy.deepcopy(bridge.model)
    summary = ProcessingSummary(dtype=str(dtype).removeprefix("torch."))
    for item in unreadable_weights(model):
        _materialize(model, item, dtype, operation, summary, bridge.adapter)
    return Processed(type(bridge)(model, tokenizer=bridge.tokenizer), summary)


def _fixed_by_dequantization(value: Any) -> bool:
    problem = weight_problem(value)
    return problem is None or problem.quantized


def _planned_bytes(item: UnreadableWeight, dtype: torch.dtype, operation: str) -> int:
    """Memory the float version of an unreadable weight will take (raises if not rebuildable)."""
    if not item.is_module:
        numel = item.value.numel() if isinstance(item.value, torch.Tensor) else 0
        return numel * dtype.itemsize
    module: Any = item.module
    if is_experts_module(module):
        return float_experts_bytes(module, dtype)
    if not hasattr(module, "in_features"):
        raise NotImplementedError(
            f"qlens cannot {operation}: {item.name} ({type(module).__name__}) is quantized "
            "and qlens does not rebuild a float module of this kind; dequantize its weights with "
            "qlens.dequantize(module) and load them into a float copy of the model first"
        )
    return int(module.in_features) * int(module.out_features) * dtype.itemsize


def _materialize(
    model: nn.Module,
    item: UnreadableWeight,
    dtype: torch.dtype,
    operation: str,
    summary: Any,
    adapter: Any,
) -> None:
    if not item.is_module:
        value = read_tensor(item.value, operation=operation, owner=model, dequantize=True)
        replace_tensor(item.module, item.name.rsplit(".", 1)[-1], value.to(dtype))
        summary.materialized[item.name] = value.numel() * dtype.itemsize
        return
    parent_name, _, child = item.name.rpartition(".")
    if is_experts_module(item.module):
        experts = float_experts(
            model,
            item.name,
            dtype=dtype,
            operation=operation,
            layout=adapter.experts_gate_up_layout or "halves",
            stored_in_out=adapter.experts_weights_in_out,
        )
        setattr(model.get_submodule(parent_name), child, experts)
        summary.materialized[item.name] = float_experts_bytes(item.module, dtype)
        return
    weight = read_weight(item.module, operation=operation, owner=model, dequantize=True)
    bias = read_optional(item.module, "bias", operation=operation, owner=model)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype)
    linear.requires_grad_(False)
    write_weight(linear, weight.to(dtype))
    if bias is not None:
        write_tensor(linear, "bias", bias.to(dtype))
    setattr(model.get_submodule(parent_name), child, linear)
    summary.materialized[item.name] = weight.numel() * dtype.itemsize
