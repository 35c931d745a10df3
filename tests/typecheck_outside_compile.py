"""The tests' runtime type checker: beartype, except while torch.compile traces.

Dynamo cannot trace beartype's checks, and the shapes it traces are symbolic, so a checked
function traced by ``torch.compile`` runs unchecked; every eager call is still checked.
jaxtyping's own wrapper is off while dynamo traces too: its memo of the dimension sizes bound
by the eager call around a compiled region (a prompt's length) would become guards, and the
region would recompile for every size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from beartype import beartype
from jaxtyping._config import config as _jaxtyping_config


class _JaxtypingConfigOffWhileCompiling(type(_jaxtyping_config)):  # type: ignore[misc]
    """jaxtyping's configuration, reading ``jaxtyping_disable`` as True while dynamo traces."""

    @property
    def jaxtyping_disable(self) -> bool:
        return torch.compiler.is_compiling() or self.__dict__.get("_disable", False)

    @jaxtyping_disable.setter
    def jaxtyping_disable(self, value: bool) -> None:
        self.__dict__["_disable"] = value


_jaxtyping_config.__class__ = _JaxtypingConfigOffWhileCompiling


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
