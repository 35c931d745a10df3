"""Harvest hook activations over a dataset, one shard per ``torchrun`` rank.

Each rank takes a contiguous slice of the examples (see ``qlens.distributed.sharding``), runs it
through the bridge in batches, gathers the activations onto the CPU and writes its shard
(``shard-{rank:05d}-of-{world:05d}.safetensors`` + ``.json`` manifest, see
``qlens.distributed.shards``). ``load_harvest(out_dir)`` reassembles the union in dataset order.

Command (one process per GPU; ``--gpus-per-rank K`` splits each rank's model over K GPUs)::

    torchrun --nproc-per-node 2 -m qlens.distributed.harvest --model PATH_OR_DEFAULT \\
        --names 'blocks.*.hook_resid_post' --dataset FILE --out DIR --batch-size 8
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from qlens.bridge import Bridge
from qlens.bridge.names import OPT_IN_SUFFIXES, unknown_name_error
from qlens.distributed import process_group
from qlens.distributed.dataset import Dataset, dataset_tokens, read_dataset
from qlens.distributed.sharding import check_rank, shard_range, world_sizes_in
from qlens.distributed.shards import merge_shards, write_shard

GLOB_CHARS = "*?["


def resolve_patterns(patterns: str | Sequence[str], valid: Sequence[str]) -> list[str]:
    """Hook names selected by exact names and ``fnmatch`` globs, in the model's order.

    A glob skips opt-in names (``attn.hook_result``); name them exactly to harvest them. Every
    entry must select at least one name.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise ValueError("no hook names given; pass names such as 'blocks.*.hook_resid_post'")
    selected: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"hook names must be str, got {type(pattern).__name__}")
        if not any(c in pattern for c in GLOB_CHARS):
            if pattern not in valid:
                raise unknown_name_error(pattern, valid)
            selected.add(pattern)
            continue
        matched = [
            n for n in valid if fnmatch.fnmatchcase(n, pattern) and not n.endswith(OPT_IN_SUFFIXES)
        ]
        if not matched:
            raise KeyError(
                f"hook pattern {pattern!r} matches no hook name of this model (e.g. "
                f"{', '.join(valid[:3])}, ...); bridge.hook_names lists all {len(valid)}"
            )
        selected.update(matched)
    return [n for n in valid if n in selected]


def harvest(
    bridge: Bridge,
    dataset_tokens_or_texts: Dataset,
    names: str | Sequence[str],
    out_dir: str | Path,
    batch_size: int,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    dtype: torch.dtype | None = None,
    prepend_bos: bool | None = None,
    model_name: str | None = None,
) -> Path:
    """Cache the activations at ``names`` for this rank's shard of a dataset and write it.

    Args:
        bridge: the model; it may be split over devices (``device_map``). Activations are
            gathered onto the CPU after each batch.
        dataset_tokens_or_texts: a list of strings (tokenized together and right-padded to the
            longest, so all ranks agree on ``pos``) or a token tensor ``[example pos]``.
        names: exact hook names and/or globs such as ``"blocks.*.hook_resid_post"``.
        out_dir: directory for the shard files (created if needed).
        batch_size: examples per forward.
        rank, world_size: this process's shard; both None reads them from ``torchrun`` (starting
            the process group: NCCL on GPU, Gloo on CPU) or means rank 0 of 1.
        dtype: cast activations to this dtype before writing (default: as produced).
        prepend_bos: for strings; None takes ``bridge.cfg.default_prepend_bos``.
        model_name: recorded in the manifest (default: the model's ``name_or_path``).

    Returns the path of this rank's manifest. Bad names, ranks or inputs raise before any forward.
    """
    selected = resolve_patterns(names, bridge.hook_names)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither (to read them from torchrun)")
    if prepend_bos is None:
        prepend_bos = bridge.cfg.default_prepend_bos
    tokens, mask = dataset_tokens(dataset_tokens_or_texts, bridge.tokenizer, prepend_bos)
    info = process_group.init_from_env() if rank is None else None
    if info is not None:
        rank, world_size = info.rank, info.world_size
    assert rank is not None and world_size is not None
    try:
        check_rank(rank, world_size)
        out_dir = Path(out_dir)
        other = sorted(set(world_sizes_in(out_dir)) - {world_size})
        if other:
            raise FileExistsError(
                f"{str(out_dir)!r} already holds a harvest with world size {other}; use an "
                "empty directory"
            )
        name = (
            model_name or getattr(bridge.model, "name_or_path", "") or type(bridge.model).__name__
        )
        process_group.agree(
            (selected, name, _digest(tokens, mask), batch_size, world_size, str(dtype)),
            "the model, hook names, dataset, batch size or dtype",
        )
        examples = shard_range(int(tokens.shape[0]), rank, world_size)
        activations = _run_shard(bridge, tokens, mask, selected, examples, batch_size, dtype)
        path = write_shard(
            out_dir,
            rank,
            world_size,
            activations,
            torch.arange(examples.start, examples.stop),
            tokens[examples.start : examples.stop],
            mask[examples.start : examples.stop],
            {"model": name, "n_examples": int(tokens.shape[0]), "batch_size": batch_size},
        )
        process_group.barrier()  # every shard is on disk once any rank returns
        return path
    finally:
        if info is not None and info.initialized_here:
            torch.distributed.destroy_process_group()


@torch.no_grad()
def _run_shard(
    bridge: Bridge,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    names: list[str],
    examples: range,
    batch_size: int,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for start in range(examples.start, examples.stop, batch_size):
        stop = min(start + batch_size, examples.stop)
        batch_mask = mask[start:stop]
        _, cache = bridge.run_with_cache(
            tokens[start:stop],
            names_filter=names,
            device="cpu",
            attention_mask=batch_mask if bool((batch_mask == 0).any()) else None,
            return_type=None,
        )
        for name in names:
            value = cache[name]
            parts[name].append(value if dtype is None else value.to(dtype))
    if not examples:  # an empty shard still records each name's trailing shape and dtype
        _, cache = bridge.run_with_cache(
            tokens[:1], names_filter=names, device="cpu", return_type=None
        )
        return {n: cache[n][:0] if dtype is None else cache[n][:0].to(dtype) for n in names}
    return {name: torch.cat(values) for name, values in parts.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qlens.distributed.harvest",
        description="Cache hook activations over a dataset; under torchrun each rank writes "
        "its contiguous shard of the examples to OUT.",
    )
    parser.add_argument(
        "--model",
        default="default",
        help="model directory or hub id (local cache); 'default': the embedded SmolLM2-135M",
    )
    parser.add_argument(
        "--names", nargs="+", required=True, help="hook names or globs, e.g. 'blocks.*.hook_z'"
    )
    parser.add_argument(
        "--dataset", required=True, help=".txt (a line per example), .jsonl or .safetensors"
    )
    parser.add_argument("--out", required=True, help="output directory for the shards")
    parser.add_argument("--batch-size", type=int, required=True, help="examples per forward")
    parser.add_argument(
        "--dtype",
        default=None,
        help="model dtype, e.g. bfloat16 (default: float32, or the quantizer's for quantized "
        "checkpoints)",
    )
    parser.add_argument(
        "--save-dtype", default=None, help="cast activations before writing, e.g. bfloat16"
    )
    parser.add_argument(
        "--gpus-per-rank",
        type=int,
        default=None,
        help="GPUs per process; above 1 the model is split over them with device_map='auto' "
        "(default: this node's GPUs shared equally between its processes)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="after all ranks finish, rank 0 also writes the union to OUT/merged",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from qlens.loading import load
    from qlens.models import DEFAULT_MODEL_NAME

    model_dtype, save_dtype = _dtype(args.dtype), _dtype(args.save_dtype)
    info = process_group.init_from_env(args.gpus_per_rank)
    try:
        placement: dict[str, object] = {}
        if torch.cuda.is_available():
            gpus = process_group.rank_gpus(
                info.local_rank, info.local_world_size, args.gpus_per_rank
            )
            if len(gpus) == 1:
                placement["device"] = f"cuda:{gpus[0]}"
            else:
                # leave a tenth of each GPU's free memory for activations
                free = {g: int(torch.cuda.mem_get_info(g)[0] * 0.9) for g in gpus}
                placement.update(device_map="auto", max_memory=free)
        dataset = read_dataset(args.dataset)  # file errors surface before the model loads
        model = None if args.model == "default" else args.model
        bridge = load(model, dtype=model_dtype, **placement)  # type: ignore[arg-type]
        manifest = harvest(
            bridge,
            dataset,
            args.names,
            args.out,
            args.batch_size,
            info.rank,
            info.world_size,
            dtype=save_dtype,
            model_name=DEFAULT_MODEL_NAME if model is None else args.model,
        )
        print(f"rank {info.rank}/{info.world_size}: wrote {manifest}", file=sys.stderr)
        if args.merge and info.rank == 0:
            print(f"merged: {merge_shards(args.out)}", file=sys.stderr)
        process_group.barrier()
    finally:
        if info.initialized_here:
            torch.distributed.destroy_process_group()
    return 0


def _digest(tokens: torch.Tensor, mask: torch.Tensor) -> str:
    data = torch.cat([tokens, mask]).to(torch.int64).contiguous().numpy().tobytes()
    return f"{tuple(tokens.shape)}:{hashlib.sha256(data).hexdigest()}"


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use e.g. float32, bfloat16, float16")
    return value


if __name__ == "__main__":
    sys.exit(main())
