"""benchmarks/bridge_decode_host.py on a tiny model: its variants generate what they claim and
its table has a ratio a variant."""

from __future__ import annotations

import torch

from benchmarks import bridge_decode_host as bench


def test_variants_generate_the_same_tokens_unless_steered():
    model, bridge = bench.build(layers=2, device=torch.device("cpu"))
    with torch.no_grad():
        outputs = {name: run() for name, run in bench.variants(model, bridge, 4).items()}
    plain = outputs["plain HF generate"]
    assert plain.shape == (1, bench.PROMPT_TOKENS + 4)
    assert torch.equal(outputs["bridge, no hooks"], plain)
    assert torch.equal(outputs["bridge, a reading hook on every layer"], plain)
    assert outputs["bridge, one steering hook"].shape == plain.shape


def test_table_has_every_variant_against_plain_hf(capsys):
    text = bench.main(["--layers", "2", "--tokens", "2", "--rounds", "1"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "plain HF generate",
        "bridge, no hooks",
        "bridge, one steering hook",
        "bridge, a reading hook on every layer",
    ]
    assert rows[0].endswith("| 1.000x |")
    assert all(float(row.split(" | ")[-1][:-3]) > 0 for row in rows)
    assert "- command: `python " in text
