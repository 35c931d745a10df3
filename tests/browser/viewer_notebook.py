"""The notebook the browser test opens: the cells of docs/viewers.md, one per code block."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

DOC = Path(__file__).parents[2] / "docs" / "viewers.md"
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def viewer_cells() -> list[str]:
    """The python blocks of docs/viewers.md (setup first, then one viewer per block)."""
    return _BLOCK.findall(DOC.read_text(encoding="utf-8"))


def write_notebook(path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(code.strip()) for code in viewer_cells()]
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, path)
