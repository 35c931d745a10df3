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


# llama.cpp's keys for the Qwen-MoE expert widths, which transformers' GGUF config reader does
# not map, and the config fields they set.
EXPERT_WIDTH_FIELDS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def set_expert_widths(config: Any, reader: Any, architecture: str) -> None:
    """Set ``config``'s expert widths from the file's ``{architecture}.expert_*_length`` keys
    (where the config has the field and the file the key)."""
    for key, field in EXPERT_WIDTH_FIELDS.items():
        value = int_field(reader, f"{architecture}.{key}")
        if value is not None and hasattr(config, field):
            setattr(config, field, value)
