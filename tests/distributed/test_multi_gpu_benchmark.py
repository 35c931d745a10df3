"""`benchmarks/multi_gpu.py --cpu-simulate` runs every check of the multi-GPU benchmark on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "multi_gpu.py"


def test_cpu_simulation_passes_every_check(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(BENCHMARK), "--cpu-simulate", "--seq-len", "16", "--examples", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = (tmp_path / "multi_gpu.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "PASS" in line]
    for check in ("split placement", "every cached activation", "patched blocks.3"):
        assert any(check in row for row in rows), check
    for scheme in ("mxfp4", "fp8-block"):
        assert any(f"{scheme}: quantized modules ran on every device" in row for row in rows)
        assert any(f"{scheme}: logits, split vs one device" in row for row in rows)
    assert any("torchrun harvest, 2 ranks: union vs one process" in row for row in rows)
    assert "FAIL" not in report
