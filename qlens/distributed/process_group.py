"""Ranks from ``torchrun``: read its environment and initialise ``torch.distributed``.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the
rendezvous address for each process it starts. The backend is NCCL when CUDA is available
(each rank then uses its own GPU, see :func:`rank_gpus`) and Gloo on CPU-only machines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    initialized_here: bool  # this call started the process group (and should end it)


def launched_by_torchrun() -> bool:
    return all(var in os.environ for var in TORCHRUN_VARS)


def backend() -> str:
    """``"nccl"`` when CUDA is usable, else ``"gloo"``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_gpus(local_rank: int, local_world_size: int, gpus_per_rank: int | None) -> list[int]:
    """The GPUs of one rank on its node: ``gpus_per_rank`` consecutive ones (default: this node's
    GPUs shared equally between its ranks)."""
    count = torch.cuda.device_count()
    if gpus_per_rank is None:
        gpus_per_rank = max(1, count // local_world_size)
    first = local_rank * gpus_per_rank
    if gpus_per_rank < 1 or first + gpus_per_rank > count:
        raise ValueError(
            f"rank {local_rank} of {local_world_size} on this node needs GPUs "
            f"{first}..{first + gpus_per_rank - 1}, but the node has {count}; start fewer "
            "processes (torchrun --nproc-per-node) or lower --gpus-per-rank"
        )
    return list(range(first, first + gpus_per_rank))


def init_from_env(gpus_per_rank: int | None = None) -> RankInfo:
    """Rank and world size of this process, starting the process group under ``torchrun``.

    With NCCL, the rank's first GPU (see :func:`rank_gpus`) becomes its current device. Outside ``torchrun`` (and with no process group started by the caller) this is rank 0 of 1.
    """
    if dist.is_available() and dist.is_initialized():
        return RankInfo(
            dist.get_rank(),
            dist.get_world_size(),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            initialized_here=False,
        )
    if not launched_by_torchrun():
        return RankInfo(0, 1, 0, 1, initialized_here=False)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    chosen = backend()
    if chosen == "nccl":
        device = torch.device("cuda", rank_gpus(local_rank, local_world, gpus_per_rank)[0])
        torch.cuda.set_device(device)
        dist.init_process_group(backend=chosen, device_id=device)
    else:
        dist.init_process_group(backend=chosen)
    return RankInfo(
        dist.get_rank(), dist.get_world_size(), local_rank, local_world, initialized_here=True
    )


def agree(value: object, what: str) -> None:
    """Raise on every rank unless all ranks hold the same ``value`` (no-op without a group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    differing = [rank for rank, other in enumerate(values) if other != values[0]]
    if differing:
        raise RuntimeError(
            f"ranks {differing} disagree with rank 0 on {what}; launch every rank with the same "
            "arguments and inputs"
        )


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
