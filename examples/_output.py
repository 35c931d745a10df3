"""Shared by the examples: where to write the static HTML views (``--out DIR``), if anywhere."""

from __future__ import annotations

import argparse
from pathlib import Path


def output_dir(description: str) -> Path | None:
    """Parse ``--out DIR``; the examples write their viewers' static HTML there when given."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, help="write the static HTML views into this directory")
    out = parser.parse_args().out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    return out


def save_html(out: Path | None, name: str, html: str) -> None:
    """Write ``html`` as ``out/name`` (no-op without ``--out``)."""
    if out is not None:
        (out / name).write_text(f"<!doctype html><meta charset='utf-8'>{html}", encoding="utf-8")
        print(f"wrote {out / name}")
