"""Markers for the kernel tests: ``gpu`` tests run only on a CUDA device without the interpreter."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and TRITON_INTERPRET unset or 0")
