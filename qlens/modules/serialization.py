"""Save and reload models holding QuantLinear / QuantExperts: safetensors + a JSON manifest.

A saved directory holds ``model.safetensors`` (every tensor of the state dict, payload tensors
included, tied tensors stored once, plus non-persistent buffers such as rotary frequencies), ``qlens_quantized.json`` (the transformers class, each
quantized module's payload formats, layouts and shapes, and the tied-tensor aliases) and the HF
``config.json``. Loading builds the model skeleton without allocating its float weights, puts
the quantized modules back, and loads every tensor as saved: the reloaded model computes exactly
what the saved one did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qlens.modules import ExpertGate, QuantExperts, QuantLinear
from qlens.modules.payload_buffers import PayloadModule, PayloadSpec, buffer_name
from qlens.quant.payload import QuantPayload

MANIFEST_FILE = "qlens_quantized.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


def save_quantized(model_or_bridge: Any, directory: str | Path) -> Path:
    """Write ``model_or_bridge`` (a transformers model or a Bridge over one) to ``directory``.

    A Bridge's tokenizer is saved too, so ``qlens.load(directory)`` gives a Bridge that takes text.
    """
    model = _model_of(model_or_bridge)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(
            f"save_quantized needs a transformers PreTrainedModel (with a .config); got "
            f"{type(model).__name__}"
        )
    _refuse_library_quantization(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    # Derived buffers (rotary inv_freq...) are not in the state dict, but their dtype and values
    # after casts shape the logits, so they are saved too.
    derived = {n: b for n, b in model.named_buffers() if n not in state}
    tensors, aliases = _deduplicated({**state, **derived})
    modules = {
        name: _module_entry(module)
        for name, module in model.named_modules()
        if isinstance(module, PayloadModule)
    }
    manifest = {
        "qlens_format_version": FORMAT_VERSION,
        "model_class": type(model).__name__,
        "modules": modules,
        "aliases": aliases,
        "non_persistent_buffers": sorted(derived),
    }
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    config.save_pretrained(directory)
    tokenizer = getattr(model_or_bridge, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)  # qlens.load(directory) finds it there
    return directory


def load_quantized(directory: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """The model saved by :func:`save_quantized` in ``directory``, on ``device``, in eval mode."""
    import transformers
    from accelerate import init_empty_weights

    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {MANIFEST_FILE}: it was not written by qlens.save_quantized "
            f"(for a plain Hugging Face checkpoint use transformers' from_pretrained)"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("qlens_format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{manifest_path} has format version {manifest.get('qlens_format_version')}; this "
            f"qlens reads version {FORMAT_VERSION}"
        )
    model_class = getattr(transformers, manifest["model_class"], None)
    if not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        raise ValueError(
            f"{manifest['model_class']} is not a transformers model class; qlens only reloads "
            f"models whose code ships with transformers"
        )
    config = transformers.AutoConfig.from_pretrained(directory)
    tensors = load_file(str(directory / WEIGHTS_FILE), device=str(device))
    with init_empty_weights(include_buffers=False):
        model = model_class(config)
    for name, entry in manifest["modules"].items():
        model.set_submodule(name, _rebuild_module(name, entry, tensors))
    derived = {n: tensors.pop(n) for n in manifest["non_persistent_buffers"] if n in tensors}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    aliases: dict[str, str] = manifest["aliases"]
    problems = [f"unexpected tensor {k}" for k in unexpected]
    problems += [f"missing tensor {k}" for k in missing if k not in aliases]
    if problems:
        raise ValueError(
            f"{directory} does not match {manifest['model_class']}: " + "; ".join(problems)
        )
    for name, buffer in derived.items():
        owner_name, _, leaf = name.rpartition(".")
        model.get_submodule(owner_name)._buffers[leaf] = buffer
    for alias, source in aliases.items():
        _tie(model, alias, source)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ValueError(f"{directory} left tensors unloaded (still on meta): {on_meta}")
    return model.to(device).eval()


def _model_of(model_or_bridge: Any) -> nn.Module:
    if isinstance(model_or_bridge, nn.Module):
        return model_or_bridge
    model = getattr(model_or_bridge, "model", None)
    if isinstance(model, nn.Module):
        return model
    raise TypeError(f"expected an nn.Module or a Bridge; got {type(model_or_bridge).__name__}")


def _refuse_library_quantization(model: nn.Module) -> None:
    """save_quantized writes qlens payloads; library-quantized modules need their own format."""
    from qlens.quant.adopt import is_quantized_module

    foreign = [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if not isinstance(m, PayloadModule) and is_quantized_module(m)
    ]
    if foreign or getattr(model.config, "quantization_config", None) is not None:
        held = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "") or "none found"
        raise ValueError(
            "save_quantized saves models quantized by qlens (QuantLinear/QuantExperts); this model "
            f"was quantized by a library (config.quantization_config, modules: {held}). Save it "
            "with its own save_pretrained, or convert it with qlens.quantize from float weights"
        )


def _deduplicated(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to save (each storage once) and ``alias -> saved name`` for tied tensors."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        ptr = tensor.untyped_storage().data_ptr()
        # A view into a storage already saved (not an exact alias) gets its own copy.
        tensors[name] = tensor.detach().clone() if ptr in storages else tensor.detach().contiguous()
        storages.add(ptr)
    return tensors, aliases


def _module_entry(module: PayloadModule) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "kind": type(module).__name__,
        "payloads": {p: s.to_json() for p, s in module.payload_specs().items()},
    }
    if not isinstance(module, QuantExperts | QuantLinear):
        raise TypeError(f"save_quantized does not know how to rebuild {type(module).__name__}")
    if isinstance(module, QuantExperts):
        entry["gate"] = module.gate.to_dict()
    if module.w8a8:
        entry["w8a8"] = True
    return entry


def _payload(
    path: str, prefix: str, entry: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> QuantPayload:
    spec = PayloadSpec.from_json(entry)

    def take(name: str) -> torch.Tensor:
        key = f"{path}.{buffer_name(prefix, name)}"
        if key not in tensors:
            raise ValueError(f"the saved weights lack {key}, needed by the quantized module {path}")
        return tensors[key]

    return spec.build([take(n) for n in spec.tensor_names])


def _rebuild_module(
    path: str, entry: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> nn.Module:
    payloads = {p: _payload(path, p, s, tensors) for p, s in entry["payloads"].items()}
    if entry["kind"] == "QuantLinear":
        return QuantLinear(
            payloads["weight"], tensors.get(f"{path}.bias"), w8a8=entry.get("w8a8", False)
        )
    if entry["kind"] == "QuantExperts":
        return QuantExperts(
            payloads["gate_up"],
            payloads["down"],
            ExpertGate(**entry["gate"]),
            tensors.get(f"{path}.gate_up_bias"),
            tensors.get(f"{path}.down_bias"),
            w8a8=entry.get("w8a8", False),
        )
    raise ValueError(f"unknown quantized module kind {entry['kind']!r} for {path}")


def _tie(model: nn.Module, alias: str, source: str) -> None:
    owner_name, _, leaf = alias.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = model.get_parameter(source)
    else:
        owner._buffers[leaf] = model.get_buffer(source)
