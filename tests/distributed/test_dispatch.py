"""A model split across devices (accelerate dispatch, CPU + disk offload) behaves like one device.

Offloaded layers keep their weights on the meta device and load them from disk for their own
forward; the bridge must see exactly the activations of a single-device run, fire hooks in every
layer, let patching hooks edit offloaded layers, and leave the dispatched model as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import dispatch_model
from dist_models import save_tiny, split_map, tiny_model

import qlens
from qlens import Bridge

OFFLOADED = {1, 2}
TOKENS = torch.tensor([[1, 4, 5, 6, 7, 8, 9], [1, 10, 11, 12, 13, 14, 4]])


def placement(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    return {n: (str(p.device), p.data_ptr()) for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(single-device bridge, bridge over the same weights loaded with a CPU/disk device map)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    directory = save_tiny(arch, root / "model")
    single = qlens.load(directory)
    split = qlens.load(
        directory,
        device_map=split_map(single.cfg.n_layers, OFFLOADED),
        offload_folder=str(root / "offload"),
    )
    return single, split


def test_split_really_offloads(pair: tuple[Bridge, Bridge]) -> None:
    _, split = pair
    layers = split.model.model.layers
    for i, layer in enumerate(layers):
        device = layer.self_attn.q_proj.weight.device.type
        assert device == ("meta" if i in OFFLOADED else "cpu"), (i, device)
    assert {split.model.hf_device_map[f"model.layers.{i}"] for i in OFFLOADED} == {"disk"}


def test_logits_and_every_cached_activation_equal_single_device(
    pair: tuple[Bridge, Bridge],
) -> None:
    single, split = pair
    logits, cache = single.run_with_cache(TOKENS)
    split_logits, split_cache = split.run_with_cache(TOKENS)
    assert torch.equal(split_logits, logits)
    assert list(split_cache.keys()) == list(cache.keys())
    assert any(name.startswith("blocks.2.attn.hook_pattern") for name in cache.keys())
    for name in cache.keys():
        assert split_cache[name].device.type == "cpu", name
        assert torch.equal(split_cache[name], cache[name]), name


def test_hooks_fire_once_in_every_layer_with_materialized_tensors(
    pair: tuple[Bridge, Bridge],
) -> None:
    _, split = pair
    seen: dict[str, str] = {}

    def record(x: torch.Tensor, hook: qlens.HookPoint) -> None:
        assert hook.name not in seen, f"{hook.name} fired twice"
        seen[hook.name] = x.device.type

    names = [f"blocks.{i}.{s}" for i in range(split.cfg.n_layers) for s in ("hook_resid_pre",)]
    names += [f"blocks.{i}.attn.hook_pattern" for i in range(split.cfg.n_layers)]
    split.run_with_hooks(TOKENS, fwd_hooks=[(n, record) for n in names])
    assert seen == {n: "cpu" for n in names}


def test_patching_an_offloaded_layer_matches_single_device(pair: tuple[Bridge, Bridge]) -> None:
    single, split = pair
    target = "blocks.2.hook_attn_out"

    def ablate(x: torch.Tensor, hook: qlens.HookPoint) -> torch.Tensor:
        return torch.zeros_like(x)

    clean = split(TOKENS)
    patched = split.run_with_hooks(TOKENS, fwd_hooks=[(target, ablate)])
    expected = single.run_with_hooks(TOKENS, fwd_hooks=[(target, ablate)])
    assert not torch.equal(patched, clean)
    assert torch.equal(patched, expected)
    # the patch did not stick: the next plain run is the clean one again
    assert torch.equal(split(TOKENS), clean)


def test_the_bridge_does_not_move_the_dispatched_model(pair: tuple[Bridge, Bridge]) -> None:
    _, split = pair
    before = placement(split.model)
    device_map = dict(split.model.hf_device_map)
    split.run_with_cache(TOKENS)
    split.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_mlp_out", lambda x, hook: x * 2)])
    assert placement(split.model) == before
    assert split.model.hf_device_map == device_map
    assert all(hasattr(split.model.model.layers[i], "_hf_hook") for i in OFFLOADED)


def test_dispatch_model_on_a_loaded_model_matches(tmp_path: Path) -> None:
    reference = Bridge(tiny_model("llama"))
    model = tiny_model("llama")
    dispatch_model(model, device_map=split_map(3, {0, 2}), offload_dir=str(tmp_path))
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    logits, cache = reference.run_with_cache(TOKENS, names_filter=lambda n: "resid" in n)
    split_logits, split_cache = Bridge(model).run_with_cache(
        TOKENS, names_filter=lambda n: "resid" in n
    )
    assert torch.equal(split_logits, logits)
    for name in cache.keys():
        assert torch.equal(split_cache[name], cache[name]), name


def test_offloaded_embedding(tmp_path: Path) -> None:
    reference = Bridge(tiny_model("llama"))
    model = tiny_model("llama")
    dispatch_model(model, device_map=split_map(3, {1}, embed="disk"), offload_dir=str(tmp_path))
    assert torch.equal(Bridge(model)(TOKENS), reference(TOKENS))


def test_harvest_over_a_split_model_equals_one_device(
    pair: tuple[Bridge, Bridge], tmp_path: Path
) -> None:
    from qlens.distributed.harvest import harvest
    from qlens.distributed.shards import load_harvest

    single, split = pair
    names = ["blocks.*.hook_resid_post", "blocks.2.attn.hook_z"]
    harvest(single, TOKENS, names, tmp_path / "single", 1)
    for rank in range(2):
        harvest(split, TOKENS, names, tmp_path / "split", 1, rank=rank, world_size=2)
    expected, got = load_harvest(tmp_path / "single"), load_harvest(tmp_path / "split")
    assert list(got.activations) == list(expected.activations)
    for name, value in expected.activations.items():
        assert torch.equal(got[name], value), name
