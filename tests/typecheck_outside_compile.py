"""The tests' runtime type checker: beartype, except while torch.compile traces.

Dynamo cannot trace beartype's checks, and the shapes it traces are symbolic, so a checked
function traced by ``torch.compile`` runs unchecked; every eager call is still checked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from beartype import beartype


def beartype_outside_compile(obj: Any) -> Any:
    """``beartype(obj)``, skipped for calls made while ``torch.compile`` traces."""
    checked = beartype(obj)
    if isinstance(obj, type) or checked is obj:
        return checked

    @functools.wraps(obj)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return obj(*args, **kwargs)
        return checked(*args, **kwargs)

    return call
