"""Quantization audit: every weight of a model, readable or not, with its format, bits and bytes.

Readability is the guard's verdict (``qlens.weights.storage.unreadable_weights``). A quantized
module (a qlens QuantLinear/QuantExperts or a library-quantized module qlens adopts) counts as one
weight per payload, sized by the payload (packed data, scales and zero points); its float biases
are listed as weights of their own. Tied parameters are listed once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.adopt.compressed_tensors import is_quantization_metadata
from qlens.quant.guards import unreadable_weight_reason
from qlens.quant.payload import QuantPayload
from qlens.weights.access import is_payload_module
from qlens.weights.storage import UnreadableWeight, float_dtype, unreadable_weights


@dataclass(frozen=True)
class WeightRow:
    """One weight: where it is, whether qlens can read it as floats, and what it costs."""

    name: str
    shape: list[int]
    elements: int  # logical weight elements (0 when the layout is unknown)
    readable: bool
    format: str  # a float dtype name ("float32") or a quantization format ("mxfp4")
    bits_per_weight: float | None  # None when the storage cannot be interpreted
    bytes: int
    reason: str | None = None  # why the guard refuses it


@dataclass(frozen=True)
class WeightAudit:
    """The rows of one model, and their totals against the model's float dtype."""

    rows: list[WeightRow]
    baseline_dtype: torch.dtype  # the dtype the model keeps its float weights in

    @property
    def total_bytes(self) -> int:
        return sum(row.bytes for row in self.rows)

    @property
    def total_weights(self) -> int:
        """Logical weight elements over every row."""
        return sum(row.elements for row in self.rows)

    @property
    def baseline_bytes(self) -> int:
        """What the same weights take held in ``baseline_dtype``."""
        return self.total_weights * self.baseline_dtype.itemsize

    @property
    def compression_ratio(self) -> float:
        return self.baseline_bytes / max(self.total_bytes, 1)

    @property
    def formats(self) -> list[str]:
        """The quantization formats of the unreadable rows."""
        return sorted({row.format for row in self.rows if not row.readable})

    def totals(self) -> dict[str, Any]:
        return {
            "weights": len(self.rows),
            "readable": sum(row.readable for row in self.rows),
            "unreadable": sum(not row.readable for row in self.rows),
            "elements": self.total_weights,
            "bytes": self.total_bytes,
            "baseline_dtype": _dtype_name(self.baseline_dtype),
            "baseline_bytes": self.baseline_bytes,
            "bits_per_weight": 8.0 * self.total_bytes / max(self.total_weights, 1),
            "compression_ratio": self.compression_ratio,
            "formats": self.formats,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"totals": self.totals(), "rows": [asdict(row) for row in self.rows]}


def audit_weights(model: nn.Module) -> WeightAudit:
    """Audit every parameter and quantized module of ``model``."""
    refused = {entry.name: entry for entry in unreadable_weights(model)}
    rows: list[WeightRow] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        where = f"{prefix}." if prefix else ""
        entry = refused.pop(prefix, None)
        quantized = entry is not None and entry.is_module
        if entry is not None and entry.is_module:
            rows += _quantized_module_rows(prefix, module, entry.reason)
        for name, parameter in module.named_parameters(recurse=False):
            problem = refused.pop(where + name, None)
            if id(parameter) in seen or is_quantization_metadata(module, name):
                continue  # tied to a parameter already listed, or a library's bookkeeping
            seen.add(id(parameter))
            if quantized and not name.endswith("bias"):
                continue  # stored codes or scales of a quantized module, counted with its payload
            reason = problem.reason if problem else unreadable_weight_reason(parameter)
            rows.append(_tensor_row(where + name, parameter, reason))
    rows += [_leftover_row(leftover) for leftover in refused.values()]
    return WeightAudit(rows, float_dtype(model))


def _quantized_module_rows(prefix: str, module: nn.Module, reason: str) -> list[WeightRow]:
    try:
        payloads = _payloads(module)
    except (ValueError, NotImplementedError, TypeError) as error:
        stored = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        size = sum(_stored_bytes(t) for t in stored)
        why = f"{reason}; qlens cannot read its layout: {error}"
        return [WeightRow(prefix, [], 0, False, "unknown", None, size, why)]
    return [
        WeightRow(
            name=f"{prefix}.{suffix}" if suffix else prefix,
            shape=list(payload.shape),
            elements=payload.numel,
            readable=False,
            format=payload.format.name,
            bits_per_weight=payload.bits_per_weight,
            bytes=payload.nbytes,
            reason=unreadable_weight_reason(payload.data) or reason,  # this payload's own codes
        )
        for suffix, payload in payloads.items()
    ]


def _payloads(module: nn.Module) -> dict[str, QuantPayload]:
    """The payloads of a quantized module by name suffix ("" for a single-weight module)."""
    if is_payload_module(module):
        holder: Any = module
        return {prefix: holder.payload_for(prefix) for prefix in holder.payload_specs()}
    if not is_quantized_module(module):
        raise ValueError(f"{type(module).__name__} is not a quantized module qlens recognises")
    adopted = adopt_module(module)
    return {"weight": adopted} if isinstance(adopted, QuantPayload) else dict(adopted)


def _tensor_row(name: str, tensor: torch.Tensor, reason: str | None) -> WeightRow:
    size = _stored_bytes(tensor)
    return WeightRow(
        name=name,
        shape=list(tensor.shape),
        elements=tensor.numel(),
        readable=reason is None,
        format=_dtype_name(tensor.dtype),
        bits_per_weight=8.0 * size / max(tensor.numel(), 1),
        bytes=size,
        reason=reason,
    )


def _leftover_row(entry: UnreadableWeight) -> WeightRow:
    """A refused weight that is not a parameter (e.g. a packed wrapper held as an attribute)."""
    value = entry.value
    if isinstance(value, torch.Tensor):
        return _tensor_row(entry.name, value, entry.reason)
    return WeightRow(entry.name, [], 0, False, type(value).__name__, None, 0, entry.reason)


def _stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor occupies; a tensor subclass is measured by the inner tensors it holds."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if type(tensor) not in (torch.Tensor, nn.Parameter) and callable(flatten):
        names, _ = flatten()
        return sum(_stored_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
