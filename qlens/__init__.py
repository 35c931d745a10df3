"""qlens: mechanistic interpretability for Hugging Face causal LMs, quantized or not.

Public names are imported lazily, so ``import qlens`` stays fast and pulls in torch and
transformers only when a feature is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from qlens.quant.libraries import quiet_library_import_noise

__version__ = "0.1.0"

quiet_library_import_noise()

_EXPORTS: dict[str, str] = {
    "Bridge": "qlens.bridge",
    "ActivationCache": "qlens.bridge",
    "BridgeConfig": "qlens.bridge",
    "HookPoint": "qlens.hooks",
    "load": "qlens.loading",
    "StaticDecoder": "qlens.static_decode",
    "fusing_backend": "qlens.kernels.sibling_fusion",
    "QuantFormat": "qlens.quant.formats",
    "QuantPayload": "qlens.quant.payload",
    "dequantize": "qlens.quant.dequantize",
    "quantize_weight": "qlens.quant.quantize",
    "SCHEMES": "qlens.quant.quantize",
    "quantize": "qlens.modules.model_quantize",
    "QuantLinear": "qlens.modules",
    "QuantExperts": "qlens.modules",
    "set_w8a8": "qlens.modules.w8a8",
    "save_quantized": "qlens.modules.serialization",
    "load_quantized": "qlens.modules.serialization",
    "reroute_quantized_modules": "qlens.modules.reroute",
    "adopt_module": "qlens.quant.adopt",
    "is_quantized_module": "qlens.quant.adopt",
    "dequantized": "qlens.weights",
    "FactoredMatrix": "qlens.weights",
    "process_weights": "qlens.weights",
    "quantization_drift": "qlens.analysis",
    "head_scores": "qlens.analysis",
    "logit_lens": "qlens.analysis",
    "harvest": "qlens.distributed.harvest",
    "load_harvest": "qlens.distributed.shards",
    "merge_shards": "qlens.distributed.shards",
    "require_readable_weight": "qlens.quant.guards",
    "unreadable_weight_reason": "qlens.quant.guards",
    "describe_quantization": "qlens.quant.guards",
    "quantization_method": "qlens.quant.guards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qlens' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
