"""Tiny random models of every supported family: the bridge tests' own configurations."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

_SOURCE = Path(__file__).resolve().parents[1] / "bridge" / "bridge_models.py"
_spec = importlib.util.spec_from_file_location("qlens_bridge_test_models", _SOURCE)
_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_models)

ARCHS: list[str] = list(_models.ARCHS)
MOE_ARCHS: list[str] = list(_models.MOE_ARCHS)


def tiny_model(arch: str) -> torch.nn.Module:
    """A cached tiny fp32 model in eval mode (shared: do not modify it)."""
    return _models.tiny_model(arch)


def perturbed_model(arch: str, seed: int = 1) -> torch.nn.Module:
    """A copy of the tiny model whose norm weights and all biases are random, so that folding
    and centering have something to move (random init leaves norms at 1 and biases at 0)."""
    model = copy.deepcopy(tiny_model(arch))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln" in name or "layernorm" in name
            if param.ndim == 1 or name.endswith("bias"):
                noise = torch.randn(param.shape, generator=generator) * 0.3
                param.copy_(noise + (1.0 if is_norm and not name.endswith("bias") else 0.0))
    return model
