"""The weight-space guard: which tensors qlens may read as plain float matrices, and why not.

A weight is readable iff it is a materialized ``torch.Tensor`` (not an uninitialized lazy
parameter, not on the meta device) that is not a quantized tensor subclass and has a real
floating-point dtype of at least 2 bytes per element (fp16, bf16, fp32, fp64). Each refusal names
one cause and a remedy that fits it: quantized storage points to explicit dequantization, the
other causes (meta, uninitialized, complex, numpy) to what actually fixes them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

DEFAULT_REMEDY = (
    "Dequantize explicitly first: qlens.dequantize(module) for one layer, the "
    "bridge.dequantized() context for a whole model, or qlens.load(path, dequantize=True) for a "
    "float copy of a quantized checkpoint."
)
META_REMEDY = (
    "Materialize the weights first: load the model without meta-device initialization (no "
    "init_empty_weights, no device_map='meta'), or onload offloaded weights onto a real device."
)
UNINITIALIZED_REMEDY = (
    "Materialize it first: run one forward pass (lazy modules infer their shapes from it) or "
    "load the checkpoint into the model."
)
COMPLEX_REMEDY = "Pass a real floating-point weight (e.g. weight.real, if that is what you mean)."
NUMPY_REMEDY = "Convert it with torch.from_numpy(array) first."


@dataclass(frozen=True)
class WeightProblem:
    """Why a weight cannot be read, whether quantization is the cause, and what fixes it."""

    reason: str
    remedy: str
    quantized: bool


# Libraries whose tensor subclasses hold quantized data behind a float-looking dtype.
_QUANTIZED_SUBCLASS_MODULES = ("torchao.", "optimum.quanto.")


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_quantized_subclass(weight: torch.Tensor) -> bool:
    """A tensor subclass whose values live elsewhere (quantized data plus scales).

    Known quantization libraries are recognised by module; any other third-party subclass that
    overrides ``__torch_dispatch__`` is a wrapper whose own storage is not the weight.
    """
    cls = type(weight)
    if cls in (torch.Tensor, torch.nn.Parameter):
        return False
    module = f"{cls.__module__}."
    if module.startswith(_QUANTIZED_SUBCLASS_MODULES):
        return True
    overrides_dispatch = getattr(cls, "__torch_dispatch__", None) is not getattr(
        torch.Tensor, "__torch_dispatch__", None
    )
    return overrides_dispatch and not module.startswith("torch.")


def weight_problem(weight: object) -> WeightProblem | None:
    """Why ``weight`` cannot be read as a float matrix, with its remedy, or None if it can."""
    if weight is None:
        return WeightProblem(
            "the weight is missing (None): the module holds its values under other names",
            DEFAULT_REMEDY,
            quantized=True,
        )
    if isinstance(weight, np.ndarray):
        return WeightProblem(
            f"the weight is a numpy array ({weight.dtype}, shape {list(weight.shape)}), not a "
            "torch.Tensor",
            NUMPY_REMEDY,
            quantized=False,
        )
    if not isinstance(weight, torch.Tensor):
        return WeightProblem(
            f"the weight is not a torch.Tensor but a {_qualname(weight)} (a packed quantized "
            "payload wrapper)",
            DEFAULT_REMEDY,
            quantized=True,
        )
    if isinstance(weight, UninitializedTensorMixin):
        return WeightProblem(
            f"the weight is an uninitialized lazy parameter ({type(weight).__name__}): it has "
            "no shape and no values yet",
            UNINITIALIZED_REMEDY,
            quantized=False,
        )
    if _is_quantized_subclass(weight):
        return WeightProblem(
            f"the weight is a quantized tensor subclass {_qualname(weight)} whose values are "
            "packed data and scales, not the weight itself",
            DEFAULT_REMEDY,
            quantized=True,
        )
    if weight.device.type == "meta":
        return WeightProblem(
            "the weight is on the meta device: it was never materialized (or was offloaded), "
            "so there are no values to read",
            META_REMEDY,
            quantized=False,
        )
    if weight.dtype.is_complex:
        return WeightProblem(
            f"the weight has complex dtype {weight.dtype}: it is not a real floating-point "
            "weight (complex is not a quantized format)",
            COMPLEX_REMEDY,
            quantized=False,
        )
    if not weight.dtype.is_floating_point:
        return WeightProblem(
            f"the weight has integer dtype {weight.dtype} and shape {list(weight.shape)}: it "
            "holds packed quantization codes, not weight values",
            DEFAULT_REMEDY,
            quantized=True,
        )
    if weight.element_size() < 2:
        return WeightProblem(
            f"the weight has 1-byte float dtype {weight.dtype}: its values mean nothing "
            "without the separate scale tensor",
            DEFAULT_REMEDY,
            quantized=True,
        )
    return None


def unreadable_weight_reason(weight: object) -> str | None:
    """Why ``weight`` cannot be read as a float matrix, or None if it can."""
    problem = weight_problem(weight)
    return None if problem is None else problem.reason


def _enum_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    return value


def quantization_method(config: Any) -> str | None:
    """``quantization_config.quant_method`` of an HF config (dict or object), or None.

    Accepts a config, a ``quantization_config`` itself, or a mapping of either; str-valued enums
    are resolved to their value.
    """
    if config is None:
        return None
    qconfig = (
        config.get("quantization_config", config)
        if isinstance(config, Mapping)
        else getattr(config, "quantization_config", config)
    )
    if qconfig is None:
        return None
    method = (
        qconfig.get("quant_method")
        if isinstance(qconfig, Mapping)
        else getattr(qconfig, "quant_method", None)
    )
    method = _enum_value(method)
    return str(method) if method is not None else None


def _owner_config(owner: Any) -> Any:
    if owner is None:
        return None
    for attr in ("config", "hf_config"):
        config = getattr(owner, attr, None)
        if config is not None:
            return config
    model = getattr(owner, "model", None)
    if model is not None and model is not owner and getattr(model, "config", None) is not None:
        return model.config
    return owner


def describe_quantization(owner: Any = None, weight: object = None) -> str:
    """The quantization method behind an unreadable weight, for error messages.

    Read from ``owner`` (a model or bridge with ``.config``, an HF config, a
    ``quantization_config``, or a dict), else from the weight's class name (e.g. bnb
    ``Params4bit``), else a generic phrase.
    """
    method = quantization_method(_owner_config(owner))
    if method:
        return method
    if weight is not None and type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return type(weight).__name__
    return "unknown quantization or non-float storage"


def require_readable_weight(
    weight: Any,
    *,
    operation: str,
    owner: Any = None,
    remedy: str | None = None,
) -> torch.Tensor:
    """Return ``weight`` unchanged if it is a readable float tensor, else raise.

    Raises ``NotImplementedError("qlens cannot <operation> because <reason> (quantization:
    <method>). <remedy>")``; problems that are not quantization (meta, uninitialized, complex,
    numpy) leave out the method and carry their own remedy unless ``remedy`` is given.
    """
    problem = weight_problem(weight)
    if problem is None:
        return weight
    if not problem.quantized:
        raise NotImplementedError(
            f"qlens cannot {operation} because {problem.reason}. {remedy or problem.remedy}"
        )
    method = describe_quantization(owner, weight)
    raise NotImplementedError(
        f"qlens cannot {operation} because {problem.reason} (quantization: {method}). "
        f"{remedy or problem.remedy}"
    )
