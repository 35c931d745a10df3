"""benchmarks/quantize_on_load.py runs end to end at --tiny size on the CPU."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quantize_on_load.py"


def _script():
    name = "qlens_benchmark_quantize_on_load"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_tiny_run_writes_a_sharded_checkpoint_and_reports_each_scheme(tmp_path):
    bench = _script()
    text = bench.main(["--tiny", "--schemes", "int4", "--dir", str(tmp_path)])
    directory = tmp_path / "random-llama-tiny"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(directory.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    row = re.search(
        r"^\| int4 \| stream \| ([\d.]+) \| ([\d.]+) \| n/a \| n/a \| ([\d.]+) \|", text, re.M
    )
    assert row is not None, text
    assert float(row.group(2)) > 0  # the quantized model's size
