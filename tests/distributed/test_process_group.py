"""Rank discovery outside torchrun, backend choice and GPU assignment on a CPU-only machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qlens.distributed import process_group


def test_outside_torchrun_is_rank_zero_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in process_group.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not process_group.launched_by_torchrun()
    info = process_group.init_from_env()
    assert (info.rank, info.world_size, info.initialized_here) == (0, 1, False)
    assert not torch.distributed.is_initialized()
    process_group.agree(object(), "nothing")  # no group: nothing to compare
    process_group.barrier()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choices")
def test_cpu_only_machine_uses_gloo_and_has_no_gpus_to_give() -> None:
    assert process_group.backend() == "gloo"
    with pytest.raises(ValueError, match="needs GPUs 0..0, but the node has 0"):
        process_group.rank_gpus(0, 1, 1)


AGREE_SCRIPT = """
import sys
import torch.distributed as dist
from qlens.distributed import process_group

info = process_group.init_from_env()
assert info.initialized_here and dist.get_backend() == "gloo", info
process_group.agree(("same", 1), "a shared value")
try:
    process_group.agree(("rank", info.rank), "the rank-dependent value")
except RuntimeError as error:
    print(f"rank {info.rank}/{info.world_size}: {error}")
process_group.barrier()
dist.destroy_process_group()
"""


def test_ranks_started_by_torchrun_join_a_gloo_group_and_compare_values(tmp_path: Path) -> None:
    script = tmp_path / "agree.py"
    script.write_text(AGREE_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    message = "ranks [1] disagree with rank 0 on the rank-dependent value"
    # Both ranks print to one pipe: a message is one write, but the two newlines may land after
    # both messages, so the messages are found in the text rather than split into lines.
    pattern = (
        rf"rank \d/2: {re.escape(message)}; launch every rank with the same arguments and inputs"
    )
    assert sorted(re.findall(pattern, run.stdout)) == [
        f"rank 0/2: {message}; launch every rank with the same arguments and inputs",
        f"rank 1/2: {message}; launch every rank with the same arguments and inputs",
    ]
