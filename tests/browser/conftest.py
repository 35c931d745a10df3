"""Chromium (Debian's, driven by Playwright) and a directory for screenshots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    """The Chromium to drive: ``QLENS_CHROMIUM`` if set, else the first on ``PATH``."""
    configured = os.environ.get("QLENS_CHROMIUM")
    if configured:
        return configured
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip(
            "browser tests need Chromium: run scripts/setup.sh as root (it installs Debian's "
            "chromium) or set QLENS_CHROMIUM to a Chromium binary"
        )
    pytest.importorskip("playwright.sync_api", reason="browser tests need playwright (test extra)")
    return path


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    """Where screenshots go: ``QLENS_ARTIFACTS`` if set, else a directory under pytest's tmp."""
    configured = os.environ.get("QLENS_ARTIFACTS")
    directory = Path(configured) if configured else tmp_path_factory.mktemp("browser-artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser screenshots: {directory}")
    return directory
