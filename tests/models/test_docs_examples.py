"""The Python examples in README.md and docs/getting_started.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.slow
@pytest.mark.parametrize("document", ["README.md", "docs/getting_started.md"])
def test_examples_run(document, capsys):
    blocks = python_blocks(ROOT / document)
    assert blocks, f"{document} has no Python examples"
    namespace: dict = {"__name__": "__docs__"}
    try:
        for block in blocks:
            exec(compile(block, document, "exec"), namespace)  # noqa: S102
    finally:
        torch.set_grad_enabled(True)  # the examples switch autograd off for the process
    assert "Paris" in capsys.readouterr().out
