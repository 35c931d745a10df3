"""Which examples each rank processes, and the file names of its shard."""

from __future__ import annotations

import re
from pathlib import Path

SHARD_PATTERN = re.compile(r"shard-(\d{5})-of-(\d{5})\.safetensors")


def shard_range(n_examples: int, rank: int, world_size: int) -> range:
    """Contiguous sharding: rank ``r`` takes examples ``[n*r // w, n*(r+1) // w)``.

    Shard sizes differ by at most one; concatenating the shards in rank order gives the dataset
    order. Ranks beyond the number of examples get an empty shard.
    """
    check_rank(rank, world_size)
    return range(n_examples * rank // world_size, n_examples * (rank + 1) // world_size)


def check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size - 1}], got {rank!r}")


def shard_stem(rank: int, world_size: int) -> str:
    check_rank(rank, world_size)
    return f"shard-{rank:05d}-of-{world_size:05d}"


def tensor_path(out_dir: Path, rank: int, world_size: int) -> Path:
    """``out_dir/shard-{rank:05d}-of-{world:05d}.safetensors``."""
    return Path(out_dir) / f"{shard_stem(rank, world_size)}.safetensors"


def manifest_path(out_dir: Path, rank: int, world_size: int) -> Path:
    """``out_dir/shard-{rank:05d}-of-{world:05d}.json``, the shard's manifest."""
    return Path(out_dir) / f"{shard_stem(rank, world_size)}.json"


def world_sizes_in(out_dir: Path) -> dict[int, list[int]]:
    """The shard files present in ``out_dir``: world size -> sorted ranks."""
    found: dict[int, list[int]] = {}
    if not Path(out_dir).is_dir():
        return found
    for path in Path(out_dir).iterdir():
        match = SHARD_PATTERN.fullmatch(path.name)
        if match:
            found.setdefault(int(match.group(2)), []).append(int(match.group(1)))
    return {world: sorted(ranks) for world, ranks in found.items()}
