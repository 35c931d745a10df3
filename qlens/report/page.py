"""The report as one self-contained HTML page: inline PNGs, inline CSS, no scripts or links."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qlens.formatting import format_bytes
from qlens.viz.static import png_img_tag

if TYPE_CHECKING:
    from qlens.report.build import Section

_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 80em; }
.qlens-table-scroll { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
td { min-width: 4em; }
td.long { min-width: 22em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; }
img { max-width: 100%; }
"""


def render_page(title: str, sections: Sequence[Section]) -> str:
    body = "".join(_section_html(section) for section in sections)
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


# Text cells longer than this keep a readable width (the table scrolls instead of squeezing).
_LONG_TEXT = 40


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table inside a horizontal scroller; numbers are right-aligned, everything is
    escaped, long text cells keep a readable minimum width."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(value) for value in row) + "</tr>" for row in rows)
    return f'<div class="qlens-table-scroll"><table><tr>{head}</tr>{body}</table></div>'


class Bytes(int):
    """A byte count that a report table shows human-readably (``1.5 MiB``)."""


def _cell(value: object) -> str:
    if isinstance(value, Bytes):
        return f'<td class="num" title="{int(value):,} B">{format_bytes(value)}</td>'
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return f'<td class="num">{text}</td>'
    text = str(value)
    long = ' class="long"' if len(text) > _LONG_TEXT else ""
    return f"<td{long}>{html.escape(text)}</td>"


def _section_html(section: Section) -> str:
    content = section.html or f"<pre>{html.escape(section.text)}</pre>"
    images = "".join(
        f"<figure>{png_img_tag(png, f'{section.title}: {name}')}</figure>"
        for name, png in section.figures.items()
    )
    return f'<section id="{html.escape(section.key)}"><h2>{html.escape(section.title)}</h2>{content}{images}</section>'
