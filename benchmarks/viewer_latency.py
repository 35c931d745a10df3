"""Viewer load and interaction times in JupyterLab + Chromium, against the targets.

Runs the browser tests (``tests/browser``), which record each viewer's first drawing and each
interaction's input-to-next-paint time, and prints a Markdown table with the targets: a viewer's
first drawing <= 1 s and an interaction <= 100 ms on an idle 2-core machine (30 layers, 128
tokens). The machine's load average is printed with the table: times on a loaded machine are
inflated and say little about the targets.

    python benchmarks/viewer_latency.py [--out benchmarks/results/viewers_browser_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD_TARGET_MS = 1000.0
INTERACTION_TARGET_MS = 100.0
ROOT = Path(__file__).resolve().parents[1]


def measure() -> dict:
    """Run the per-viewer browser tests once and return the times they recorded."""
    with tempfile.TemporaryDirectory() as scratch:
        timings = Path(scratch) / "timings.json"
        env = {**os.environ, "QLENS_VIEWER_TIMINGS": str(timings)}
        command = [sys.executable, "-m", "pytest", "tests/browser", "-q", "-p", "no:randomly"]
        command += ["-k", "reacts_in_the_browser or renders_as_a_widget"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not timings.exists():
            raise SystemExit(
                f"the browser tests failed:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
            )
        return json.loads(timings.read_text())


def table(report: dict) -> str:
    rows = ["| what | measured (ms) | target (ms) | within |", "|---|---:|---:|:-:|"]
    for name, ms in report["load_ms"].items():
        rows.append(
            f"| {name} load | {ms:.1f} | ≤ {LOAD_TARGET_MS:.0f} | "
            f"{'yes' if ms <= LOAD_TARGET_MS else 'no'} |"
        )
    for name, ms in report["interaction_ms"].items():
        rows.append(
            f"| {name} | {ms:.1f} | ≤ {INTERACTION_TARGET_MS:.0f} | "
            f"{'yes' if ms <= INTERACTION_TARGET_MS else 'no'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args()
    before = os.getloadavg()
    report = measure()
    header = [
        "# Viewers in the browser (JupyterLab + Chromium)",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
        f"load average (1 min) {before[0]:.1f} before and {report['load_average'][0]:.1f} after",
        f"- Python {platform.python_version()}",
        "- command: `python benchmarks/viewer_latency.py`",
        "- model: docs/viewers.md's random 30-layer Llama, 128 tokens",
        "- load: render start to the paint after the first drawing; interaction: input event to "
        "the next paint, measured in the page",
        "",
    ]
    text = "\n".join(header) + "\n" + table(report) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
