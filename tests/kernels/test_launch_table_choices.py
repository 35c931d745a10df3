"""The launch tables choose what they chose before they became data: every (rows, shape, GPU,
weight kind) case of ``launch_table_choices.json``, recorded from the tables as Python tuples."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_the_record_covers_every_path():
    paths = {expected["path"] for _, expected in CASES}
    assert paths == {"gemv", "splitk", "gemm", "dequant", "cublas"}
