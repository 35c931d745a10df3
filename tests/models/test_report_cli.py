"""The `qlens report` command, end to end and in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import qlens
from qlens.cli import main


@pytest.mark.slow
def test_report_of_the_default_model_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "qlens", "report", "--top-k", "5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "1. ' Paris'" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["top_predictions"][0]["token"] == " Paris"
    assert len(report["top_predictions"]) == 5
    assert report["run"]["tokens"] == ["The", " capital", " of", " France", " is"]
    assert len(report["residual_norms"]) == 30


def test_report_values_match_the_bridge(tiny_llama_dir, tmp_path, capsys):
    prompt = "w1 w2 w3 w4"
    assert (
        main(
            [
                "report",
                str(tiny_llama_dir),
                "--prompt",
                prompt,
                "--top-k",
                "3",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "report.json").read_text())

    bridge = qlens.load(tiny_llama_dir)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(prompt)
    probabilities = torch.softmax(logits[0, -1], -1)
    top = torch.topk(probabilities, 3)
    assert [row["token_id"] for row in report["top_predictions"]] == top.indices.tolist()
    assert [row["probability"] for row in report["top_predictions"]] == pytest.approx(
        top.values.tolist(), rel=1e-6
    )
    capture = report["capture"]
    assert capture["hook_points"] == len(bridge.hook_names)
    assert capture["cached_tensors"] == len(cache.keys())
    assert capture["total_bytes"] == sum(t.numel() * t.element_size() for t in cache.values())
    z = capture["kinds"]["blocks.*.attn.hook_z"]
    assert (z["count"], z["shape"]) == (2, [1, 4, 4, 8])
    expected_norms = [
        cache[f"blocks.{layer}.hook_resid_post"][0, -1].norm().item() for layer in range(2)
    ]
    assert [row["norm_last_position"] for row in report["residual_norms"]] == pytest.approx(
        expected_norms, rel=1e-6
    )
    printed = capsys.readouterr().out
    assert "blocks.*.attn.hook_pattern" in printed
    assert f"wrote {tmp_path / 'report.json'}" in printed


@pytest.mark.parametrize(
    ("argument", "message"),
    [("/no/such/model", "does not exist"), (".", "has no config.json")],
)
def test_bad_model_exits_with_a_message(argument, message, capsys):
    assert main(["report", argument]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("qlens report: error: cannot load model:")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_model_without_tokenizer_exits_with_a_message(tiny_llama_dir, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_llama_dir / name).unlink()
    assert main(["report", str(tiny_llama_dir)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_top_k_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--top-k", "0"])
    assert exit_info.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("MODEL", "--prompt", "--top-k", "--device", "--out"):
        assert option in text
