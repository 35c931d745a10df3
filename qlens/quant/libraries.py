"""Quantization libraries as qlens sees them: recognised by name, never imported to look.

qlens imports torchao, bitsandbytes, compressed-tensors, optimum-quanto, HQQ or gguf only when a
model holds their modules; it tells them apart by the module path of a class
(``type(x).__module__``). :func:`quiet_library_import_noise` drops the import-time log lines
torchao produces on CPU-only machines (its CUDA extensions failing to load, torch's deprecation of
its enum registrations), which say nothing about the user's model.
"""

from __future__ import annotations

import logging
import sys

QUANTIZATION_LIBRARIES = (
    "torchao",
    "bitsandbytes",
    "compressed_tensors",
    "optimum.quanto",
    "hqq",
    "gguf",
)

_ENUM_DEPRECATION = "is now natively supported by torch.compile as an opaque value type"


def library_of(obj: object) -> str | None:
    """The quantization library defining ``obj``'s class, or None (checked by name only)."""
    module = f"{type(obj).__module__}."
    return next((lib for lib in QUANTIZATION_LIBRARIES if module.startswith(f"{lib}.")), None)


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class _LibraryImportNoise(logging.Filter):
    """Drops torchao's CPU-only import noise; everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load") and not _cuda_available())
        return not (_ENUM_DEPRECATION in message and "Enum subclass" in message)


_FILTER = _LibraryImportNoise()


def quiet_library_import_noise() -> None:
    """Install the filter on the loggers that print torchao's import noise (idempotent)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
