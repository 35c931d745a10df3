"""Each example script runs to completion and writes its static HTML views."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
# Example -> a line its output must contain.
EXPECTED = {
    "quickstart.py": "next token: ' Paris'",
    "quantized_tour.py": "dequantized W_Q of layer 0: (9, 576, 64)",
    "induction_heads.py": "L18H6: induction score",
    "adopt_checkpoint.py": "equals bitsandbytes' dequantize_4bit exactly",
}


def test_every_example_is_covered():
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert EXPECTED[script] in result.stdout
    pages = list(tmp_path.glob("*.html"))
    assert pages and all(
        '<img src="data:image/png;base64,' in p.read_text() or "<table>" in p.read_text()
        for p in pages
    )
