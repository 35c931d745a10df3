"""Handing freed heap memory back: glibc's malloc_trim where the C library has it."""

from __future__ import annotations

import platform

import pytest

from qlens import host_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_glibc_trims():
    assert host_memory.release_freed_host_memory() is True


def test_without_malloc_trim_it_does_nothing(monkeypatch):
    monkeypatch.setattr(host_memory.ctypes.util, "find_library", lambda name: None)
    host_memory._libc.cache_clear()
    try:
        assert host_memory.release_freed_host_memory() is False
    finally:
        host_memory._libc.cache_clear()
