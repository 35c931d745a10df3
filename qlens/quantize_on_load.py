"""Quantize while loading: stream a float checkpoint tensor by tensor into a quantized model.

The model is built on the meta device, the layers ``qlens.quantize`` would quantize are planned
the same way, and the safetensors shards are read one tensor at a time, with plain file reads (no
memory map keeps a shard's pages resident). Each tensor is cast to the load dtype on the target
device; a planned layer is quantized (and its float weights dropped) as soon as its last tensor
has arrived, every other tensor is put in place. The float model is never held whole: peak
memory is the quantized model plus one layer's float weights. The result
equals ``qlens.quantize(qlens.load(path, dtype=..., device=...), scheme)`` exactly.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlens.host_memory import release_freed_host_memory
from qlens.safetensors_reads import read_safetensors

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


@dataclass
class _Pending:
    """A planned layer waiting for its float tensors."""

    plan: Any  # qlens.modules.model_quantize._Plan
    missing: set[str] = field(default_factory=set)  # its tensor names not yet loaded


def safetensors_shards(directory: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in the order of its index (if sharded)."""
    directory = Path(directory)
    index = directory / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in dict.fromkeys(weight_map.values())]
    if (directory / _SINGLE_FILE).is_file():
        return [directory / _SINGLE_FILE]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(
            f"{directory} holds no safetensors weights; quantize-on-load reads safetensors only. "
            "Load the model first and call qlens.quantize(bridge, scheme)."
        )
    return found


def load_quantizing(
    directory: str | Path,
    config: Any,
    scheme: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The causal LM in ``directory`` with ``qlens.quantize``'s layers quantized by ``scheme``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from qlens.load_checks import key_list
    from qlens.modules.model_quantize import DEFAULT_SKIP, SCHEMES, plan_quantization

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(
            f"{directory} is already quantized (quantization_config: "
            f"{_method(config)}); quantize= converts float checkpoints. Load it as it is, or "
            "with dequantize=True and then call qlens.quantize(bridge, scheme)."
        )
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plans = plan_quantization(model, DEFAULT_SKIP, on_meta=True)
    pending = {
        p.name: _Pending(p, {n for n, _ in p.module.named_parameters(recurse=True)}) for p in plans
    }
    owner_of = {
        f"{p.name}.{n}": p.name for p in plans for n, _ in p.module.named_parameters(recurse=True)
    }
    del plans  # each pending entry holds its plan (and float tensors) until its layer is quantized
    expected = dict(model.state_dict(keep_vars=True))
    loaded: set[str] = set()
    unexpected: list[str] = []
    experts = ExpertStacker(expected)
    for shard in safetensors_shards(directory):
        for stored, tensor in read_safetensors(shard):
            key = _renamed(stored, expected)
            if key not in expected and not experts.takes(key):
                unexpected.append(stored)
                continue
            if key in expected:
                arrived = {key: cast_like_from_pretrained(tensor, expected[key], dtype, device)}
            else:
                arrived = experts.add(key, tensor.to(device=device, dtype=dtype))
            del tensor
            for name, value in arrived.items():
                put_tensor(model, name, value)
                loaded.add(name)
                _advance(model, pending, owner_of, name, scheme)
    if unexpected:
        raise ValueError(
            f"{directory} holds tensors {key_list(unexpected)} that "
            f"{type(model).__name__} has no place for (a checkpoint in another layout?). "
            "quantize-on-load reads checkpoints written by save_pretrained; load this one with "
            "qlens.load(path) and quantize it with qlens.quantize(bridge, scheme)."
        )
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target not in loaded and source in loaded:
            put_tensor(model, target, model.get_parameter(source))
            loaded.add(target)
            _advance(model, pending, owner_of, target, scheme)
    left = [k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    left += [f"{name}.{n}" for name, p in pending.items() for n in sorted(p.missing)]
    if left:
        raise ValueError(
            f"{directory} lacks tensors {key_list(sorted(set(left)))}: the checkpoint is incomplete "
            "for its config, and qlens does not fill weights with random values."
        )
    model.to(device)
    return model.eval()


# Per-expert 2-D weights as save_pretrained writes them (Qwen-MoE style, or Mixtral's w1/w3/w2),
# which transformers fuses into experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and
# experts.down_proj [E, H, I] when loading.
_PER_EXPERT = re.compile(
    r"^(?P<block>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<index>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PROJ_ROLE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def _renamed(key: str, expected: dict[str, torch.Tensor]) -> str:
    """The model's name for a checkpoint key (Mixtral checkpoints call the MoE block
    ``block_sparse_moe``; transformers renames it ``mlp``)."""
    renamed = key.replace(".block_sparse_moe.", ".mlp.")
    return renamed if key not in expected and renamed in expected else key


class ExpertStacker:
    """Collects per-expert weights of one experts module until all have arrived, then fuses them."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self._expected = expected
        self._parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}

    def _target(self, key: str) -> tuple[str, int, int] | None:
        match = _PER_EXPERT.match(key)
        if match is None:
            return None
        module = f"{match['block']}.mlp.experts"
        if f"{module}.gate_up_proj" not in self._expected:
            return None
        return module, _PROJ_ROLE[match["proj"]], int(match["index"])

    def takes(self, key: str) -> bool:
        """Whether ``key`` is one expert's weight of a fused experts module of the model."""
        return self._target(key) is not None

    def add(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fused tensors of the module ``key`` completes (empty until it is complete)."""
        target = self._target(key)
        assert target is not None  # callers check takes() first
        module, role, index = target
        parts = self._parts.setdefault(module, {})
        parts[(role, index)] = tensor
        experts = self._expected[f"{module}.gate_up_proj"].shape[0]
        if len(parts) < 3 * experts:
            return {}
        del self._parts[module]

        def stacked(r: int) -> torch.Tensor:
            return torch.stack([parts[(r, e)] for e in range(experts)])

        return {
            f"{module}.gate_up_proj": torch.cat([stacked(0), stacked(1)], dim=1),
            f"{module}.down_proj": stacked(2),
        }


def _advance(
    model: nn.Module, pending: dict[str, _Pending], owner_of: dict[str, str], key: str, scheme: str
) -> None:
    """Count ``key`` as loaded; quantize its layer once all of the layer's tensors are in."""
    from qlens.modules.model_quantize import quantized_module

    name = owner_of.get(key)
    if name is None:
        return
    waiting = pending[name]
    waiting.missing.discard(key[len(name) + 1 :])
    if waiting.missing:
        return
    plan = waiting.plan
    options = {"asymmetric": False, "scale_dtype": None}  # qlens.quantize's defaults
    model.set_submodule(plan.name, quantized_module(plan, scheme, options))
    del pending[name]
    release_freed_host_memory()  # the layer's float tensors and quantization temporaries


def cast_like_from_pretrained(
    tensor: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``tensor`` as from_pretrained stores it: floats in the load dtype, others as they are."""
    target = dtype if tensor.is_floating_point() and slot.is_floating_point() else tensor.dtype
    return tensor.to(device=device, dtype=target)


def put_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Put ``value`` at parameter or buffer ``key`` of ``model`` (a Parameter kept as is)."""
    owner_name, _, leaf = key.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        keep = old.requires_grad if old is not None else False
        owner._parameters[leaf] = (
            value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=keep)
        )
    else:
        owner._buffers[leaf] = value


def _method(config: Any) -> str:
    from qlens.quant.guards import quantization_method

    return quantization_method(config) or "unknown method"
