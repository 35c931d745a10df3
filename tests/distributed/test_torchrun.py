"""The harvest command: under `torchrun --nproc-per-node 2` on CPU (Gloo) the union of the two
ranks' shards equals a single-process harvest exactly; bad names fail before any file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_models import TEXTS, save_tiny

import qlens
from qlens.distributed.harvest import harvest, main
from qlens.distributed.shards import load_harvest

NAMES = ["blocks.*.hook_resid_post", "blocks.0.mlp.hook_post"]


def torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "qlens.distributed.harvest", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("torchrun") / "model")


def test_two_ranks_union_equals_single_process(model_dir: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data.txt"
    dataset.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out"
    run = torchrun(
        "--model", str(model_dir), "--names", *NAMES, "--dataset", str(dataset),
        "--out", str(out), "--batch-size", "3", "--merge",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    manifests = [json.loads((out / f"shard-0000{r}-of-00002.json").read_text()) for r in (0, 1)]
    assert [m["example_indices"] for m in manifests] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {m["model"] for m in manifests} == {str(model_dir)}
    union = load_harvest(out)
    single_dir = tmp_path / "single"
    harvest(qlens.load(model_dir), TEXTS, NAMES, single_dir, batch_size=3, rank=0, world_size=1)
    single = load_harvest(single_dir)
    assert list(union.activations) == list(single.activations)
    assert len(single.activations) == 4
    for name, value in single.activations.items():
        assert torch.equal(union[name], value), name
    assert torch.equal(union.tokens, single.tokens)
    merged = load_harvest(out / "merged")
    for name, value in single.activations.items():
        assert torch.equal(merged[name], value), name


def test_command_rejects_bad_names_before_writing(model_dir: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data.txt"
    dataset.write_text("the cat\n")
    out = tmp_path / "out"
    args = ["--model", str(model_dir), "--names", "blocks.*.hook_resid_pots"]
    args += ["--dataset", str(dataset), "--out", str(out), "--batch-size", "1"]
    with pytest.raises(KeyError, match="matches no hook name of this model"):
        main(args)
    assert not out.exists()
