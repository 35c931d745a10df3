"""The Bridge: hook points, caching and generation on unmodified HF causal LMs."""

from qlens.bridge.adapters import ADAPTERS, Adapter, LayerPaths, get_adapter
from qlens.bridge.bridge import Bridge
from qlens.bridge.cache import ActivationCache
from qlens.bridge.config import BridgeConfig
from qlens.bridge.loss import lm_loss

__all__ = [
    "ADAPTERS",
    "ActivationCache",
    "Adapter",
    "Bridge",
    "BridgeConfig",
    "LayerPaths",
    "get_adapter",
    "lm_loss",
]
