"""Read one metadata value of a GGUF file (a gguf-py ``GGUFReader``'s fields)."""

from __future__ import annotations

from typing import Any


def text_field(reader: Any, key: str) -> str | None:
    """The string stored under ``key``, ``None`` when the file has no such key."""
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def int_field(reader: Any, key: str) -> int | None:
    """The integer stored under ``key``, ``None`` when the file has no such key."""
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])
