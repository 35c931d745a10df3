"""The ```python examples in docs/ run, each page's blocks in order in one namespace."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[2] / "docs"
# getting_started.md is exercised by its own tests.
PAGES = [
    "index.md",
    "concepts.md",
    "formats.md",
    "api.md",
    "viewers.md",
    "coming_from_transformerlens.md",
]
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def test_every_documentation_page_exists():
    expected = {*PAGES, "errors.md", "benchmarks.md"}
    assert expected <= {p.name for p in DOCS.glob("*.md")}


@pytest.mark.slow
def test_python_examples_run(tmp_path):
    script = []
    for page in PAGES:
        blocks = _BLOCK.findall((DOCS / page).read_text(encoding="utf-8"))
        assert blocks, f"{page} has no python example"
        body = "\n".join(blocks)
        script.append(f"print('== {page}')\nexec(compile({body!r}, {page!r}, 'exec'), {{}})\n")
    path = tmp_path / "docs_examples.py"
    path.write_text(textwrap.dedent("\n".join(script)), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout and "30 844" in result.stdout
