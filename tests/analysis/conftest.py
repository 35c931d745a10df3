"""Fixtures for the analysis tests: SmolLM2 (loaded once) and its quantized versions."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once per test session."""
    import qlens

    return qlens.load()


@pytest.fixture(scope="session")
def smollm2_quantized(smollm2):
    """SmolLM2 quantized with each scheme, built on first use."""
    from qlens.modules.model_quantize import quantize

    built = {}

    def get(scheme: str):
        if scheme not in built:
            built[scheme] = quantize(smollm2, scheme)
        return built[scheme]

    return get
