"""Every benchmark script imports on the CPU, has a main() and says how to run it: a renamed
helper or a launch table built at import with a bad tile fails here, not on the GPU machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
TUNING = sorted(p for p in (BENCHMARKS / "tuning").glob("*.py") if not p.name.startswith("_"))


def test_the_benchmarks_folder_has_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS
    assert len(TUNING) >= 10, TUNING


def load(script: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import their siblings, as when run
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
    return module


COMMANDS = [(p, f"python benchmarks/{p.name}") for p in SCRIPTS] + [
    (p, f"python -m benchmarks.tuning.{p.stem}") for p in TUNING
]


@pytest.mark.parametrize(("script", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_benchmark_script_imports(script, command, monkeypatch):
    module = load(script, monkeypatch)
    assert module.__doc__ and command in module.__doc__, (
        f"{script.name}'s docstring lacks {command}"
    )
