"""Activation harvesting: shards, their union, manifests, and errors before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_models import TEXTS, tiny_model, word_tokenizer
from safetensors.torch import save_file

from qlens import Bridge
from qlens.distributed.dataset import read_dataset
from qlens.distributed.harvest import harvest, resolve_patterns
from qlens.distributed.sharding import shard_range
from qlens.distributed.shards import MANIFEST_FIELDS, load_harvest, merge_shards

NAMES = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern"]


@pytest.fixture(scope="module")
def bridge() -> Bridge:
    return Bridge(tiny_model("llama"), tokenizer=word_tokenizer())


def test_shards_are_contiguous_and_cover_the_dataset_once() -> None:
    for n in (1, 7, 8, 9):
        for world in (1, 2, 3, 5):
            ranges = [shard_range(n, r, world) for r in range(world)]
            assert [i for r in ranges for i in r] == list(range(n))
            assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 1\]"):
        shard_range(8, 2, 2)


def test_glob_and_exact_names_resolve_in_model_order(bridge: Bridge) -> None:
    names = resolve_patterns(
        ["blocks.2.hook_resid_pre", "blocks.*.hook_resid_post"], bridge.hook_names
    )
    assert names == [
        "blocks.0.hook_resid_post",
        "blocks.1.hook_resid_post",
        "blocks.2.hook_resid_pre",
        "blocks.2.hook_resid_post",
    ]
    assert "blocks.0.attn.hook_result" not in resolve_patterns("blocks.0.attn.*", bridge.hook_names)


def test_union_of_shards_equals_single_process_and_plain_run_with_cache(
    bridge: Bridge, tmp_path: Path
) -> None:
    harvest(bridge, TEXTS, NAMES, tmp_path / "one", batch_size=2)
    for rank in range(2):
        harvest(bridge, TEXTS, NAMES, tmp_path / "two", 2, rank=rank, world_size=2)
    single, union = load_harvest(tmp_path / "one"), load_harvest(tmp_path / "two")
    assert (
        list(union.activations)
        == list(single.activations)
        == resolve_patterns(NAMES, bridge.hook_names)
    )
    for name in single.activations:
        assert torch.equal(union[name], single[name]), name
    assert torch.equal(union.tokens, single.tokens)
    assert torch.equal(union.attention_mask, single.attention_mask)
    # each example alone, unpadded, gives the same activations at its real positions
    for i, text in enumerate(TEXTS):
        _, cache = bridge.run_with_cache(text, names_filter=list(single.activations))
        length = int(single.attention_mask[i].sum())
        assert cache["blocks.0.hook_resid_post"].shape[1] == length
        for name in single.activations:
            expected = cache[name][0]
            got = single[name][i]
            got = got[:, :length, :length] if name.endswith("hook_pattern") else got[:length]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_merged_shards_load_like_the_shards(bridge: Bridge, tmp_path: Path) -> None:
    tokens = torch.randint(3, 15, (5, 6))
    for rank in range(3):
        harvest(bridge, tokens, "blocks.0.hook_mlp_out", tmp_path, 2, rank=rank, world_size=3)
    merged_manifest = merge_shards(tmp_path)
    merged, shards = load_harvest(merged_manifest.parent), load_harvest(tmp_path)
    assert torch.equal(merged["blocks.0.hook_mlp_out"], shards["blocks.0.hook_mlp_out"])
    assert torch.equal(merged.tokens, tokens)
    assert bool((merged.attention_mask == 1).all())
    assert merged.manifest["shards"] == 1 and shards.manifest["shards"] == 3


def test_manifest_fields(bridge: Bridge, tmp_path: Path) -> None:
    path = harvest(
        bridge, TEXTS, NAMES, tmp_path, 3, rank=1, world_size=2, dtype=torch.bfloat16,
        model_name="tiny-llama",
    )  # fmt: skip
    assert path == tmp_path / "shard-00001-of-00002.json"
    manifest = json.loads(path.read_text())
    assert set(manifest) == set(MANIFEST_FIELDS)
    assert bridge.cfg.default_prepend_bos  # strings get one BOS, as in to_tokens
    seq_len = max(len(t.split()) for t in TEXTS) + 1
    assert seq_len == bridge.to_tokens(TEXTS).shape[1]
    names = resolve_patterns(NAMES, bridge.hook_names)
    assert manifest["model"] == "tiny-llama"
    assert (manifest["rank"], manifest["world_size"], manifest["n_examples"]) == (1, 2, 8)
    assert manifest["example_indices"] == [4, 5, 6, 7]
    assert manifest["sharding"] == "contiguous" and manifest["seq_len"] == seq_len
    assert manifest["hook_names"] == names
    assert manifest["dtype"] == "bfloat16" and set(manifest["dtypes"].values()) == {"bfloat16"}
    assert manifest["shapes"]["blocks.0.hook_resid_post"] == [4, seq_len, 64]
    assert manifest["shapes"]["blocks.1.attn.hook_pattern"] == [4, 4, seq_len, seq_len]
    assert manifest["tensor_file"] == "shard-00001-of-00002.safetensors"
    assert (tmp_path / manifest["tensor_file"]).is_file()


def test_bad_names_raise_before_any_work(bridge: Bridge, tmp_path: Path) -> None:
    calls = []
    handle = bridge.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(KeyError, match="closest valid names: blocks.0.hook_resid_post"):
            harvest(bridge, TEXTS, ["blocks.0.hook_resid_pst"], tmp_path / "a", 2)
        with pytest.raises(KeyError, match=r"pattern 'blocks\.\*\.hook_nothing' matches no hook"):
            harvest(bridge, TEXTS, ["blocks.*.hook_nothing"], tmp_path / "b", 2)
        with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
            harvest(bridge, TEXTS, NAMES, tmp_path / "c", 0)
        with pytest.raises(ValueError, match="pass both rank and world_size"):
            harvest(bridge, TEXTS, NAMES, tmp_path / "d", 2, rank=0)
        with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 1\], got 2"):
            harvest(bridge, TEXTS, NAMES, tmp_path / "e", 2, rank=2, world_size=2)
        with pytest.raises(TypeError, match="int64/int32 tensor"):
            harvest(bridge, torch.zeros(2, 3), NAMES, tmp_path / "f", 2)
    finally:
        handle.remove()
    assert calls == []
    assert list(tmp_path.iterdir()) == []


def test_load_harvest_refuses_incomplete_or_mixed_directories(
    bridge: Bridge, tmp_path: Path
) -> None:
    tokens = torch.randint(3, 15, (4, 5))
    harvest(bridge, tokens, "hook_embed", tmp_path, 2, rank=0, world_size=2)
    with pytest.raises(FileNotFoundError, match=r"lacks the shards of ranks \[1\] of 2"):
        load_harvest(tmp_path)
    with pytest.raises(FileExistsError, match=r"already holds a harvest with world size \[2\]"):
        harvest(bridge, tokens, "hook_embed", tmp_path, 2)
    harvest(bridge, tokens[:3], "hook_embed", tmp_path, 2, rank=1, world_size=2)
    with pytest.raises(ValueError, match="shard 1 disagrees with shard 0 on 'n_examples'"):
        load_harvest(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no harvest shards"):
        load_harvest(tmp_path / "nothing")


def test_dataset_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("the cat\na dog ran\n")
    assert read_dataset(tmp_path / "a.txt") == ["the cat", "a dog ran"]
    (tmp_path / "b.jsonl").write_text('{"text": "the cat"}\n"a dog"\n')
    assert read_dataset(tmp_path / "b.jsonl") == ["the cat", "a dog"]
    tokens = torch.arange(6).reshape(2, 3)
    save_file({"tokens": tokens}, str(tmp_path / "c.safetensors"))
    assert torch.equal(read_dataset(tmp_path / "c.safetensors"), tokens)
    (tmp_path / "d.txt").write_text("the cat\n\na dog\n")
    with pytest.raises(ValueError, match="line 2 is empty"):
        read_dataset(tmp_path / "d.txt")
    (tmp_path / "e.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match="line 1: expected a JSON string or an object"):
        read_dataset(tmp_path / "e.jsonl")
    (tmp_path / "f.csv").write_text("x\n")
    with pytest.raises(ValueError, match="use .txt"):
        read_dataset(tmp_path / "f.csv")


def test_more_ranks_than_examples_leave_empty_shards(bridge: Bridge, tmp_path: Path) -> None:
    tokens = torch.randint(3, 15, (2, 4))
    for rank in range(3):
        harvest(bridge, tokens, "blocks.0.hook_resid_pre", tmp_path, 4, rank=rank, world_size=3)
    manifests = [
        json.loads((tmp_path / f"shard-0000{r}-of-00003.json").read_text()) for r in range(3)
    ]
    assert [m["example_indices"] for m in manifests] == [[], [0], [1]]
    assert manifests[0]["shapes"]["blocks.0.hook_resid_pre"] == [0, 4, 64]
    _, cache = bridge.run_with_cache(tokens, names_filter="blocks.0.hook_resid_pre")
    assert torch.equal(
        load_harvest(tmp_path)["blocks.0.hook_resid_pre"], cache["blocks.0.hook_resid_pre"]
    )
