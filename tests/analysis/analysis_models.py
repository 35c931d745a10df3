"""The tiny models of every family, shared with the weight tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[1] / "weights" / "arch_models.py"
_spec = importlib.util.spec_from_file_location("qlens_weights_test_models", _SOURCE)
_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_models)

ARCHS = _models.ARCHS
tiny_model = _models.tiny_model
perturbed_model = _models.perturbed_model
