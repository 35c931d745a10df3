"""Adapters for the supported model families, keyed by HF ``config.model_type``.

Adding a family: write an ``Adapter`` table (see ``qlens.bridge.adapters.base``) next to the
existing ones and add it to ``ADAPTERS`` under the model's ``config.model_type``.
"""

from __future__ import annotations

from torch import nn

from qlens.bridge.adapters.base import Adapter, LayerPaths
from qlens.bridge.adapters.gemma import GEMMA, GEMMA2, GEMMA3_TEXT
from qlens.bridge.adapters.gpt2 import GPT2
from qlens.bridge.adapters.gpt_neox import GPT_NEOX
from qlens.bridge.adapters.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from qlens.bridge.adapters.moe import GPT_OSS, MIXTRAL, QWEN2_MOE, QWEN3_MOE
from qlens.bridge.adapters.opt import OPT
from qlens.bridge.adapters.phi3 import PHI3

ADAPTERS: dict[str, Adapter] = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "mistral": MISTRAL,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3_TEXT,
    "phi3": PHI3,
    "gpt_neox": GPT_NEOX,
    "opt": OPT,
    "mixtral": MIXTRAL,
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "gpt_oss": GPT_OSS,
}


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for an HF causal LM, or a ValueError naming the supported families."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"qlens has no adapter for model_type {model_type!r} ({type(model).__name__}). "
            f"Supported: {', '.join(sorted(ADAPTERS))}. To add one, write an Adapter table "
            "(see qlens.bridge.adapters.base) and register it in qlens.bridge.adapters.ADAPTERS."
        )
    adapter = ADAPTERS[model_type]
    if adapter.check_config is not None:
        adapter.check_config(config)
    return adapter


__all__ = ["ADAPTERS", "Adapter", "LayerPaths", "get_adapter"]
