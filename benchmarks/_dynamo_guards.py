"""The guards dynamo installs while compiling, as its guard log prints them (not part of the
qlens package; the compile tests read them too)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

import torch


def logged_guards(call: Callable[[], object]) -> str:
    """The guards dynamo logs while ``call()`` compiles."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("torch._dynamo.guards")
    logger.addHandler(handler)
    torch._logging.set_logs(guards=True)
    try:
        call()
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    return stream.getvalue()
