"""Token strings made safe and readable as plot tick labels, selector labels and HTML text."""

from __future__ import annotations

import html

_VISIBLE_WHITESPACE = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible_token(token: str, max_chars: int = 20) -> str:
    """A token with control whitespace made visible, shortened to ``max_chars``; empty -> ``∅``."""
    text = "".join(_VISIBLE_WHITESPACE.get(ch, ch) for ch in token)
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
