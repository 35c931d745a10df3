"""Hand freed host memory back to the operating system.

glibc keeps memory freed by ``free`` in its arenas (one per thread that allocated), so a process
that allocates and frees many medium-sized tensors, as a streaming load does, keeps growing its
resident size with memory it no longer uses. ``malloc_trim`` returns the free pages of every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed_host_memory() -> bool:
    """Return glibc's free heap pages to the OS; False where the C library has no ``malloc_trim``
    (macOS, musl), which then does nothing."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
