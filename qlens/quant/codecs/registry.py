"""One registry mapping a format name to the function that dequantizes its payloads."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from qlens.quant.payload import QuantPayload

Dequantizer = Callable[[QuantPayload, torch.dtype], torch.Tensor]

# Every codec module registers its formats when imported.
_CODEC_MODULES = (
    "fp8",
    "mx",
    "nvfp4",
    "intgroup",
    "bnb",
    "bitnet",
    "gguf",
    "higgs",
    "hqq",
    "nf4_torchao",
)
_DEQUANTIZERS: dict[str, Dequantizer] = {}
_loaded = False


def register_dequantizer(*format_names: str) -> Callable[[Dequantizer], Dequantizer]:
    """Decorator registering ``fn(payload, dtype) -> Tensor`` for the given format names."""

    def decorate(fn: Dequantizer) -> Dequantizer:
        for name in format_names:
            if name in _DEQUANTIZERS and _DEQUANTIZERS[name] is not fn:
                raise RuntimeError(f"format {name!r} already has a dequantizer")
            _DEQUANTIZERS[name] = fn
        return fn

    return decorate


def _load_codecs() -> None:
    global _loaded
    if not _loaded:
        for module in _CODEC_MODULES:
            name = f"qlens.quant.codecs.{module}"
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                if error.name != name:  # a real import failure inside the codec
                    raise
                # this codec is not part of the installation: its formats stay unknown
        _loaded = True


def dequantizer_for(format_name: str) -> Dequantizer:
    """The dequantizer registered for ``format_name``; raises naming the known formats."""
    _load_codecs()
    try:
        return _DEQUANTIZERS[format_name]
    except KeyError:
        known = ", ".join(sorted(_DEQUANTIZERS))
        raise ValueError(
            f"no dequantizer for format {format_name!r}; known formats: {known}"
        ) from None


def known_formats() -> list[str]:
    _load_codecs()
    return sorted(_DEQUANTIZERS)
