"""Token strings made safe and readable as plot tick labels, selector labels and HTML text."""

from __future__ import annotations

import html
import re
from functools import cache
from typing import Any

# Control whitespace is drawn as a symbol; a token made only of spaces shows them as ``␣``.
_VISIBLE_WHITESPACE = {"\n": "⏎", "\t": "⇥", "\r": "␍"}
_BYTE_TOKEN = re.compile(r"(<0x[0-9A-Fa-f]{2}>)+")


def visible_token(token: str, max_chars: int = 20) -> str:
    """A token with control whitespace made visible, shortened to ``max_chars``; empty -> ``∅``.

    Newlines show as ``⏎``, tabs as ``⇥``; a token of spaces only shows each as ``␣``.
    """
    text = "".join(_VISIBLE_WHITESPACE.get(ch, ch) for ch in token)
    if text and not text.strip(" "):
        text = "␣" * len(text)
    if len(text) > max_chars:
        text = text[: max_chars - 1] + "…"
    return text or "∅"


def token_label(token: str, max_chars: int = 12) -> str:
    """A token as a matplotlib label (``$`` escaped, as matplotlib would read it as math)."""
    return visible_token(token, max_chars).replace("$", r"\$")


def token_html(token: str) -> str:
    """A token as escaped HTML text with its spaces kept visible."""
    return html.escape(visible_token(token, 40)).replace(" ", "&nbsp;")


def position_labels(tokens: list[str]) -> list[str]:
    """``"3: token"`` labels for selectors, one per position."""
    return [f"{i}: {visible_token(t)}" for i, t in enumerate(tokens)]


@cache
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte-to-character map (printable bytes map to
    themselves; the others to the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token; a token holding part of a UTF-8 character (which decodes to
    ``�``) is shown as its bytes, e.g. ``<0xE2><0x80>``."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and _BYTE_TOKEN.fullmatch(piece):
        return piece
    decoder = _byte_level_decoder()
    if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
        return "".join(f"<0x{decoder[ch]:02X}>" for ch in piece)
    return text
