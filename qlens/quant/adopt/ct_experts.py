"""compressed-tensors MoE checkpoints: experts saved as per-expert compressed linears.

llm-compressor saves each expert's projections as compressed linears
(``...experts.3.gate_proj.weight_packed``, ``weight_scale``, ``weight_global_scale``...; Mixtral:
``w1``/``w3``/``w2``), while transformers 5 holds the experts of a layer fused in one float module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``). Loading converts them, sometimes wrongly
(NVFP4 experts lose their global scale) or not at all (Mixtral experts left randomly
initialised). :func:`check_fused_experts` compares every loaded expert with qlens' exact decoding
of the checkpoint's compressed tensors and refuses the model when they differ.
"""

from __future__ import annotations

import logging
import re
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import adopt_module, is_quantized_module
from qlens.quant.payload import QuantPayload

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.(?P<name>weight_packed|weight|weight_scale|weight_global_scale|weight_zero_point|"
    r"weight_shape)$"
)
_ROLE = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


def _qconfig(config: Any) -> dict[str, Any] | None:
    qconfig = getattr(config, "quantization_config", None)
    if qconfig is not None and not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict() if hasattr(qconfig, "to_dict") else None
    if isinstance(qconfig, dict) and qconfig.get("quant_method") == "compressed-tensors":
        return qconfig
    return None


def _scheme(qconfig: dict[str, Any]) -> Any:
    """The scheme of the config group that quantizes linears (what per-expert linears use)."""
    from compressed_tensors.quantization import QuantizationArgs

    for group in (qconfig.get("config_groups") or {}).values():
        if group.get("weights"):
            fmt = group.get("format") or qconfig.get("format")
            return types.SimpleNamespace(weights=QuantizationArgs(**group["weights"]), format=fmt)
    return None


Slots = dict[tuple[int, str], dict[str, tuple[Path, str]]]


def _expert_keys(directory: Path) -> dict[str, Slots]:
    """``{experts prefix: {(expert, role): {tensor name: (file, key)}}}`` of the checkpoint
    (names only: tensors are read one projection at a time)."""
    from safetensors import safe_open

    found: dict[str, Slots] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = _EXPERT_KEY.match(key)
                if match is None:
                    continue
                slot = (int(match["expert"]), _ROLE[match["proj"]])
                found.setdefault(match["prefix"], {}).setdefault(slot, {})[match["name"]] = (
                    file,
                    key,
                )
    return found


def _read(where: dict[str, tuple[Path, str]]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for name, (file, key) in where.items():
        with safe_open(str(file), "pt") as handle:
            tensors[name] = handle.get_tensor(key)
    return tensors


def _decode(
    tensors: dict[str, torch.Tensor], scheme: Any, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """One expert projection decoded from its checkpoint tensors (``shape`` when none says it)."""
    from qlens.quant.dequantize import dequantize

    holder: Any = nn.Module()
    holder.out_features, holder.in_features = int(shape[0]), int(shape[1])
    for name, value in tensors.items():
        holder.register_buffer(name, value)
    holder.quantization_scheme = scheme
    if (
        "weight_packed" not in tensors
        and tensors["weight"].is_floating_point()
        and (tensors["weight"].element_size() > 1)
    ):
        return tensors["weight"].to(dtype)  # saved unquantized
    payload = adopt_module(holder)
    if not isinstance(payload, QuantPayload):
        raise TypeError(f"a compressed-tensors expert projection adopted as {sorted(payload)}")
    return dequantize(payload, dtype)


def _fused(module: nn.Module, role: str, expert: int) -> torch.Tensor | None:
    gate_up: Any = getattr(module, "gate_up_proj", None)
    if role == "down":
        down: Any = getattr(module, "down_proj", None)
        return down[expert] if isinstance(down, torch.Tensor) else None
    if not isinstance(gate_up, torch.Tensor):
        return None
    half = gate_up.shape[1] // 2
    return gate_up[expert, :half] if role == "gate" else gate_up[expert, half:]


def check_fused_experts(model: nn.Module, location: str) -> None:
    """Refuse a compressed-tensors checkpoint whose experts transformers loaded wrongly.

    Does nothing unless ``model`` was loaded from a local compressed-tensors checkpoint holding
    per-expert compressed linears. Experts that arrived right, but dequantized to float by
    transformers, are logged (qlens' quantized forward does not run for them).
    """
    qconfig = _qconfig(getattr(model, "config", None))
    directory = Path(location)
    if qconfig is None or not directory.is_dir():
        return
    saved = _expert_keys(directory)
    scheme = _scheme(qconfig) if saved else None
    for prefix, slots in saved.items():
        module = model.get_submodule(prefix) if _has_submodule(model, prefix) else None
        example = f"{prefix}.0.*.{'/'.join(sorted(next(iter(slots.values()))))}"
        if module is not None and is_quantized_module(module):
            continue
        worst = 0.0
        for (expert, role), where in sorted(slots.items()):
            loaded = None if module is None else _fused(module, role, expert)
            if loaded is None or loaded.device.type == "meta":
                worst = float("inf")
                break
            expected = _decode(_read(where), scheme, loaded.shape, loaded.dtype)
            if expected.shape != loaded.shape:
                worst = float("inf")
                break
            error = (loaded.float() - expected.float()).abs()
            bound = 2 * torch.finfo(loaded.dtype).eps * expected.float().abs()
            if bool((error > bound).any()):
                worst = max(worst, float(error.max()))
        if worst > 0:
            raise ValueError(
                f"transformers did not load the compressed-tensors experts of {prefix} "
                f"(checkpoint tensors {example}) correctly: the loaded "
                f"{type(module).__name__ if module is not None else 'model'} experts differ from "
                f"the checkpoint's values by up to {worst:.4g} (e.g. a dropped "
                "weight_global_scale, or experts left randomly initialised). qlens refuses the "
                "model rather than analyse wrong weights; load it with a transformers/"
                "compressed-tensors pair that converts these experts, or dequantize the "
                "checkpoint to float first."
            )
        logger.warning(
            "the compressed-tensors experts of %s arrived dequantized to %s by transformers "
            "(exact, but not packed: qlens' quantized forward does not run for them)",
            prefix,
            next(iter(module.parameters())).dtype if module is not None else "float",
        )


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
