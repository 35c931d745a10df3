"""What `qlens.load` checks and converts after transformers has loaded a checkpoint.

A checkpoint whose tensors do not match its model is refused (transformers would initialise the
missing weights at random and only log a warning), and so are experts that the checkpoint's
quantization config quantizes but that arrived as float. ``dequantize=True`` turns every
quantized module into its exact float counterpart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qlens.quant.guards import quantization_method

# Methods whose transformers integration quantizes fused experts too (unless told to skip them).
_EXPERTS_QUANTIZING_METHODS = ("compressed-tensors", "fp8", "mxfp4")


def require_complete_load(model: nn.Module, info: dict[str, Any], location: str) -> None:
    """Raise if transformers reported missing, unexpected or mismatched tensors, or float experts.

    ``info`` is the loading info of ``from_pretrained(..., output_loading_info=True)``. Missing
    and mismatched tensors always raise (they would be random); unexpected ones raise for
    quantized checkpoints, whose packed tensors must all find their module.
    """
    config = getattr(model, "config", None)
    method = quantization_method(config)
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing (would be random): {key_list(info['missing_keys'])}")
    if info.get("mismatched_keys"):
        shapes = [
            str(item[0]) if isinstance(item, tuple) else str(item)
            for item in info["mismatched_keys"]
        ]
        problems.append(f"with mismatched shapes (would be random): {key_list(shapes)}")
    if method and info.get("unexpected_keys"):
        problems.append(f"unexpected (left unused): {key_list(info['unexpected_keys'])}")
    floats = float_experts_problems(model)
    if floats:
        problems.append(
            f"quantized by the config ({method}) but loaded as float: {key_list(floats)}"
        )
    if problems:
        raise ValueError(
            f"{location!r} did not load into {type(model).__name__} intact; tensors "
            + "; tensors ".join(problems)
            + ". The checkpoint does not match what transformers "
            "builds for its config (a different layout, a quantization method or version "
            "transformers cannot read, or an incomplete download). qlens refuses it rather than "
            "return wrong weights."
        )


def float_experts_problems(model: nn.Module) -> list[str]:
    """Fused experts modules that ``config.quantization_config`` quantizes but that hold floats."""
    from qlens.modules.hf_experts import is_fused_experts

    config = getattr(model, "config", None)
    qconfig = getattr(config, "quantization_config", None)
    if quantization_method(config) not in _EXPERTS_QUANTIZING_METHODS:
        return []
    kept = _config_list(qconfig, "modules_to_not_convert")
    ignored = _config_list(qconfig, "ignore")
    found = []
    for name, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        weight: torch.Tensor = getattr(module, "gate_up_proj")  # noqa: B009 (checked above)
        if not (weight.is_floating_point() and weight.element_size() >= 2):
            continue
        if any(k in name for k in kept) or any(_ignores(p, name) for p in ignored):
            continue
        found.append(f"{name} ({weight.dtype})")
    return found


def dequantized_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with every quantized module replaced in place by its exact float version."""
    from qlens.bridge import Bridge
    from qlens.weights.materialize import prepare

    prepare(Bridge(model), "load with dequantize=True", dequantize=True, inplace=True, dtype=dtype)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # the model is no longer quantized
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    return model.to(dtype)


def _config_list(qconfig: Any, key: str) -> list[str]:
    value = qconfig.get(key) if isinstance(qconfig, dict) else getattr(qconfig, key, None)
    return [str(v) for v in value or []]


def _ignores(pattern: str, name: str) -> bool:
    """compressed-tensors' ``ignore`` entries: ``re:<regex>`` or a module name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def key_list(keys: Iterable[str]) -> str:
    """The first few of ``keys`` (sorted), and how many more, for error messages."""
    keys = sorted(keys)
    shown = ", ".join(keys[:6])
    return shown + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
