"""The one registry of quantization formats: a :class:`Codec` per format name."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from qlens.quant.codecs.codec import Codec, Dequantizer

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
_CODECS: dict[str, Codec] = {}
_loaded = False


def register_codec(codec: Codec) -> Codec:
    """Register ``codec`` under its format name; a name is registered once."""
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec takes a Codec, got {type(codec).__name__}")
    existing = _CODECS.get(codec.name)
    if existing is not None:
        raise ValueError(
            f"format {codec.name!r} is already registered (dequantized by "
            f"{existing.dequantize.__module__}.{existing.dequantize.__qualname__}); a format is "
            f"registered once: unregister_codec({codec.name!r}) first to replace it"
        )
    if codec.quantize is not None:
        taken = next((c for c in _CODECS.values() if c.scheme == codec.scheme), None)
        if taken is not None:
            raise ValueError(
                f"quantize scheme {codec.scheme!r} already quantizes to format {taken.name!r}; "
                "give the new format another scheme name"
            )
    _CODECS[codec.name] = codec
    return codec


def unregister_codec(format_name: str) -> Codec:
    """Remove a registered format and return its codec."""
    _load_codecs()
    try:
        return _CODECS.pop(format_name)
    except KeyError:
        raise ValueError(f"format {format_name!r} is not registered") from None


def register_dequantizer(*format_names: str) -> Callable[[Dequantizer], Dequantizer]:
    """Decorator registering a codec with only ``fn(payload, dtype) -> Tensor`` for each name."""

    def decorate(fn: Dequantizer) -> Dequantizer:
        for name in format_names:
            register_codec(Codec(name, fn))
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
        _in_module_order()
        _loaded = True


def _in_module_order() -> None:
    """Order the codecs as their modules are listed (a module imported early registers early),
    then the formats registered from elsewhere, so listings do not depend on import order."""
    modules = [f"qlens.quant.codecs.{m}" for m in _CODEC_MODULES]

    def rank(codec: Codec) -> int:
        module = codec.dequantize.__module__
        return modules.index(module) if module in modules else len(modules)

    ordered = sorted(_CODECS.values(), key=rank)  # stable: registration order within a module
    _CODECS.clear()
    _CODECS.update((c.name, c) for c in ordered)


def codec_for(format_name: str) -> Codec:
    """The codec registered for ``format_name``; raises naming the known formats."""
    _load_codecs()
    try:
        return _CODECS[format_name]
    except KeyError:
        known = ", ".join(sorted(_CODECS))
        raise ValueError(
            f"no dequantizer for format {format_name!r}; known formats: {known}"
        ) from None


def codecs() -> list[Codec]:
    """Every registered codec, the built-in ones first (in their modules' order)."""
    _load_codecs()
    return list(_CODECS.values())


def dequantizer_for(format_name: str) -> Dequantizer:
    """The dequantizer registered for ``format_name``; raises naming the known formats."""
    return codec_for(format_name).dequantize


def known_formats() -> list[str]:
    """Every registered format name, sorted."""
    _load_codecs()
    return sorted(_CODECS)
