"""The launch tables choose what they chose before they became data: every (rows, shape, GPU,
weight kind) case of ``launch_table_choices.json``, recorded from the tables as Python tuples (the
H100's cases since updated to the H200's choices: Hopper GPUs share the tuned tables; one-row
symmetric int4 since updated to the unpipelined 4-row tiles every packed row takes)."""

from __future__ import annotations

import json
from pathlib import Path

from qlens.kernels import launch_tables
from qlens.kernels.configs import LinearConfig, _table_config

CASES = json.loads((Path(__file__).parent / "data" / "launch_table_choices.json").read_text())


def test_every_recorded_choice_is_unchanged():
    assert len(CASES) == 18 * 9 * 3 * 4
    changed = [
        (args, expected, _table_config(*args))
        for args, expected in CASES
        if _table_config(*args) != LinearConfig(**expected)
    ]
    assert not changed, changed[:5]


def test_the_h100_takes_the_h200s_launches():
    h200 = {
        (*args[:3], *args[5:]): expected for args, expected in CASES if args[3] == "NVIDIA H200"
    }
    h100 = [(args, expected) for args, expected in CASES if "H100" in args[3]]
    assert h100 and all(expected == h200[(*a[:3], *a[5:])] for a, expected in h100)


def test_the_record_covers_every_path():
    paths = {expected["path"] for _, expected in CASES}
    assert paths == {"gemv", "splitk", "gemm", "dequant", "cublas"}


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def cited_sections(evidence: str) -> list[tuple[str, str]]:
    return [tuple(part.split(" § ", 1)) for part in evidence.split("; ")]  # type: ignore[misc]


def test_every_table_row_and_constant_cites_a_recorded_measurement():
    entries = [row.evidence for table in launch_tables.TABLES.values() for row in table]
    entries += [tuned.evidence for tuned in launch_tables.TUNED.values()]
    measured = [e for e in entries if e != launch_tables.FALLBACK]
    assert len(measured) == 10 + len(launch_tables.TUNED)
    for evidence in measured:
        for filename, section in cited_sections(evidence):
            text = (BENCHMARKS / filename).read_text()
            headings = [
                line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")
            ]
            assert section == "top" or any(h.startswith(section) for h in headings), evidence


def test_only_the_fallback_tables_cite_no_measurement():
    for name, table in launch_tables.TABLES.items():
        unmeasured = {row.evidence == launch_tables.FALLBACK for row in table}
        assert unmeasured == {name.startswith("DEFAULT_")}, name
