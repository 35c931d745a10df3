"""Harvest shards on disk: write one, read them all back in example order, merge them.

A shard is two files in the output directory (see ``qlens.distributed.sharding``):

* ``shard-{rank:05d}-of-{world:05d}.safetensors`` holding one tensor per hook name
  ``[examples_in_shard, pos, ...]`` plus ``example_indices`` ``[examples_in_shard]`` (positions
  in the dataset), ``tokens`` and ``attention_mask`` ``[examples_in_shard, pos]``;
* ``shard-{rank:05d}-of-{world:05d}.json``, its manifest (see :data:`MANIFEST_FIELDS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from safetensors.torch import load_file, save_file
from torch import Tensor

from qlens.distributed.sharding import manifest_path, tensor_path, world_sizes_in

FORMAT = "qlens-harvest"
FORMAT_VERSION = 1
INDEX_KEY, TOKENS_KEY, MASK_KEY = "example_indices", "tokens", "attention_mask"
RESERVED_KEYS = (INDEX_KEY, TOKENS_KEY, MASK_KEY)
MANIFEST_FIELDS = (
    "format",  # "qlens-harvest"
    "version",  # layout version of the files
    "model",  # the model's name or path
    "rank",
    "world_size",
    "sharding",  # "contiguous": rank r holds examples [n*r//w, n*(r+1)//w)
    "n_examples",  # examples in the whole dataset
    "seq_len",  # positions per example (strings are right-padded to the longest)
    "example_indices",  # dataset positions held by this shard, in file order
    "hook_names",
    "shapes",  # hook name -> shape of its tensor in this shard
    "dtypes",  # hook name -> dtype name, e.g. "float32"
    "dtype",  # the dtype shared by every hook tensor, or null when they differ
    "batch_size",
    "tensor_file",  # file name of the safetensors file
)
# Fields that every shard of one harvest must agree on.
SHARED_FIELDS: tuple[str, ...] = (
    "format",
    "version",
    "model",
    "world_size",
    "sharding",
    "n_examples",
    "seq_len",
    "hook_names",
    "dtypes",
    "dtype",
)


@dataclass
class Harvest:
    """Activations of a whole harvest in dataset order.

    ``activations[name]`` is ``[n_examples, pos, ...]``; row ``i`` is example ``i``. Rows of
    ``attention_mask`` are 0 at padding positions, whose activations are not meaningful.
    """

    activations: dict[str, Tensor]
    tokens: Int[Tensor, "example pos"]
    attention_mask: Int[Tensor, "example pos"]
    manifest: dict[str, Any]

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.activations:
            raise KeyError(f"{name!r} was not harvested; harvested: {', '.join(self.activations)}")
        return self.activations[name]


def write_shard(
    out_dir: Path,
    rank: int,
    world_size: int,
    activations: dict[str, Tensor],
    example_indices: Int[Tensor, " example"],
    tokens: Int[Tensor, "example pos"],
    attention_mask: Int[Tensor, "example pos"],
    info: dict[str, Any],
) -> Path:
    """Write one shard's tensors and manifest (``info`` adds model/n_examples/...); returns the
    manifest's path."""
    clash = [name for name in activations if name in RESERVED_KEYS]
    if clash:
        raise ValueError(f"hook names {clash} collide with reserved shard keys {RESERVED_KEYS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.contiguous() for name, value in activations.items()}
    tensors[INDEX_KEY] = example_indices.to(torch.int64)
    tensors[TOKENS_KEY] = tokens.to(torch.int64)
    tensors[MASK_KEY] = attention_mask.to(torch.int64)
    dtypes = {name: _dtype_name(value.dtype) for name, value in activations.items()}
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **info,
        "rank": rank,
        "world_size": world_size,
        "sharding": "contiguous",
        "seq_len": int(tokens.shape[1]),
        "example_indices": [int(i) for i in example_indices],
        "hook_names": list(activations),
        "shapes": {name: list(value.shape) for name, value in activations.items()},
        "dtypes": dtypes,
        "dtype": next(iter(set(dtypes.values()))) if len(set(dtypes.values())) == 1 else None,
        "tensor_file": tensor_path(out_dir, rank, world_size).name,
    }
    missing = [field for field in MANIFEST_FIELDS if field not in manifest]
    if missing:
        raise ValueError(f"shard manifest lacks {missing}; pass them in info")
    save_file(tensors, str(tensor_path(out_dir, rank, world_size)), metadata={"format": FORMAT})
    path = manifest_path(out_dir, rank, world_size)
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def load_harvest(out_dir: str | Path) -> Harvest:
    """Read every shard in ``out_dir`` and reassemble the union in dataset order.

    Raises if shards are missing, disagree (model, hook names, dtypes, dataset size), or do not
    cover every example exactly once.
    """
    out_dir = Path(out_dir)
    found = world_sizes_in(out_dir)
    if not found:
        raise FileNotFoundError(
            f"{str(out_dir)!r} holds no harvest shards (shard-XXXXX-of-XXXXX.safetensors); "
            "pass the --out directory of a finished harvest"
        )
    if len(found) > 1:
        raise ValueError(
            f"{str(out_dir)!r} mixes harvests with world sizes {sorted(found)}; keep one harvest "
            "per directory"
        )
    world_size, ranks = next(iter(found.items()))
    if ranks != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        raise FileNotFoundError(
            f"{str(out_dir)!r} lacks the shards of ranks {missing} of {world_size}; did every "
            "rank finish?"
        )
    manifests = [_read_manifest(out_dir, rank, world_size) for rank in ranks]
    first = manifests[0]
    for manifest in manifests[1:]:
        for field in SHARED_FIELDS:
            if manifest.get(field) != first.get(field):
                raise ValueError(
                    f"shard {manifest['rank']} disagrees with shard 0 on {field!r}: "
                    f"{manifest.get(field)!r} != {first.get(field)!r}; the shards come from "
                    "different harvests"
                )
    shards = [_read_tensors(out_dir, m) for m in manifests]
    indices = torch.cat([shard[INDEX_KEY] for shard in shards])
    n = first["n_examples"]
    if not torch.equal(torch.sort(indices).values, torch.arange(n)):
        raise ValueError(
            f"the shards' example indices do not cover examples 0..{n - 1} exactly once"
        )
    order = torch.argsort(indices)
    activations = {
        name: torch.cat([shard[name] for shard in shards])[order] for name in first["hook_names"]
    }
    manifest = {key: value for key, value in first.items() if key in SHARED_FIELDS}
    manifest["shards"] = len(manifests)
    manifest["batch_size"] = first["batch_size"]
    return Harvest(
        activations=activations,
        tokens=torch.cat([shard[TOKENS_KEY] for shard in shards])[order],
        attention_mask=torch.cat([shard[MASK_KEY] for shard in shards])[order],
        manifest=manifest,
    )


def merge_shards(out_dir: str | Path, dest: str | Path | None = None) -> Path:
    """Write the union of ``out_dir``'s shards as a single shard (``shard-00000-of-00001``) in
    ``dest`` (default ``out_dir/merged``); returns its manifest's path."""
    harvest = load_harvest(out_dir)
    dest = Path(out_dir) / "merged" if dest is None else Path(dest)
    if Path(dest).resolve() == Path(out_dir).resolve():
        raise ValueError("dest must differ from out_dir: one directory holds one harvest")
    info = {k: harvest.manifest[k] for k in ("model", "n_examples", "batch_size")}
    return write_shard(
        dest,
        0,
        1,
        harvest.activations,
        torch.arange(info["n_examples"]),
        harvest.tokens,
        harvest.attention_mask,
        info,
    )


def _read_manifest(out_dir: Path, rank: int, world_size: int) -> dict[str, Any]:
    path = manifest_path(out_dir, rank, world_size)
    if not path.is_file():
        raise FileNotFoundError(f"shard manifest {str(path)!r} is missing")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r} is not a {FORMAT} v{FORMAT_VERSION} manifest "
            f"(format={manifest.get('format')!r}, version={manifest.get('version')!r})"
        )
    if manifest.get("rank") != rank or manifest.get("world_size") != world_size:
        raise ValueError(
            f"{str(path)!r} names rank/world {manifest.get('rank')}/"
            f"{manifest.get('world_size')}, not {rank}/{world_size}"
        )
    return manifest


def _read_tensors(out_dir: Path, manifest: dict[str, Any]) -> dict[str, Tensor]:
    path = out_dir / manifest["tensor_file"]
    tensors = load_file(str(path))
    expected = set(manifest["hook_names"]) | set(RESERVED_KEYS)
    if set(tensors) != expected:
        raise ValueError(
            f"{str(path)!r} holds {sorted(tensors)}, but its manifest lists {sorted(expected)}"
        )
    for name in manifest["hook_names"]:
        shape, dtype = list(tensors[name].shape), _dtype_name(tensors[name].dtype)
        if shape != manifest["shapes"][name] or dtype != manifest["dtypes"][name]:
            raise ValueError(
                f"{str(path)!r}: {name} is {shape} {dtype}, but the manifest says "
                f"{manifest['shapes'][name]} {manifest['dtypes'][name]}"
            )
    if tensors[INDEX_KEY].tolist() != manifest["example_indices"]:
        raise ValueError(f"{str(path)!r}: example indices differ from its manifest")
    return tensors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
