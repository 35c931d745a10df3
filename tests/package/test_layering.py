"""The package's layers: ``qlens.quant`` (formats, payloads, codecs) below ``qlens.kernels``,
both below ``qlens.modules``; and qlens runs on the CPU without Triton installed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "qlens"


def _imports(folder: str) -> dict[str, set[str]]:
    """Every module each file under ``qlens/<folder>`` imports (absolute names)."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(PACKAGE.parent))] = names
    return found


def _offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {
        path: sorted(n for n in names if n.startswith(forbidden))
        for path, names in _imports(folder).items()
        if any(n.startswith(forbidden) for n in names)
    }


@pytest.mark.parametrize(
    ("folder", "above"),
    [
        ("quant", ("qlens.kernels", "qlens.modules")),
        ("kernels", ("qlens.modules",)),
    ],
)
def test_lower_layers_import_nothing_above_them(folder: str, above: tuple[str, ...]) -> None:
    assert _imports(folder), f"no files found under qlens/{folder}"
    assert _offenders(folder, above) == {}


def test_the_layering_check_sees_an_upward_import(tmp_path, monkeypatch) -> None:
    bad = tmp_path / "qlens" / "quant"
    bad.mkdir(parents=True)
    (bad / "sneaky.py").write_text("def f():\n    from qlens.kernels.plan import linear\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "qlens")
    assert _offenders("quant", ("qlens.kernels",)) == {
        "qlens/quant/sneaky.py": ["qlens.kernels.plan", "qlens.kernels.plan.linear"]
    }


NO_TRITON = """
import sys
sys.modules["triton"] = None  # importing triton now raises ImportError
import torch
import qlens
from tiny_models import input_ids, make_model

for family, scheme in (("llama", "int4"), ("qwen3_moe", "nvfp4"), ("llama", "fp8-block")):
    model = qlens.quantize(make_model(family), scheme)
    with torch.no_grad():
        logits = model(input_ids()).logits
    assert torch.isfinite(logits).all()
    layer = next(m for m in model.modules() if isinstance(m, qlens.QuantLinear))
    weight = qlens.dequantize(layer)
    assert weight.shape == (layer.out_features, layer.in_features)
assert "triton" not in {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
print("ran without triton")
"""


def test_cpu_quantize_forward_and_dequantize_need_no_triton() -> None:
    root = PACKAGE.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests" / "quant_models")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", NO_TRITON], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran without triton" in done.stdout
