"""The notebooks are stored without outputs and run headless, start to finish, without error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
INLINE_PNG = re.compile(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]{100,}')


def test_every_notebook_is_present():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_quantized_tour.ipynb",
        "03_induction_heads.ipynb",
        "04_adopt_checkpoint.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    # nbformat 4.5 requires cell ids: reading fills in missing ones with a warning today (an
    # error in later versions), so the stored file is checked as JSON.
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert all(cell.get("id") for cell in stored["cells"]), f"{path.name}: a cell has no id"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a cell has stored outputs; clear them"
            assert cell.execution_count is None, f"{path.name}: clear the execution counts"
    assert "widgets" not in notebook.metadata, f"{path.name}: remove the stored widget state"


# Run first in each notebook's kernel: on a CPU nothing may need Triton (the `triton` extra is
# for GPUs), so the notebooks run with its import blocked.
WITHOUT_TRITON = 'import sys\nsys.modules["triton"] = None  # import triton now raises ImportError'


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_headless(path, tmp_path):
    """Start to finish on a CPU with Triton's import blocked, every viewer with its static view."""
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(WITHOUT_TRITON))
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # Every viewer also renders statically: an inline PNG next to the widget view.
    html = [o.data.get("text/html", "") for o in outputs if "data" in o]
    assert any(INLINE_PNG.search(h) for h in html) or path.stem == "04_adopt_checkpoint"
