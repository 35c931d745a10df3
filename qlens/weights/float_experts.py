"""Rebuild a quantized fused-experts module as a float experts module of the model's own HF class.

Weight processing with the dequantize opt-in replaces qlens ``QuantExperts`` and transformers'
``FP8Experts`` by the float experts class of the model's family (``MixtralExperts``,
``Qwen3MoeExperts``, ``GptOssExperts``...), holding the dequantized 3-D weights in that class' own
orientation (``[E, out, in]`` or GPT-OSS' ``[E, in, out]``) and gate/up layout.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from qlens.weights.access import GateUpLayout, read_experts, split_gate_up
from qlens.weights.storage import replace_tensor, unreadable_weights


def is_experts_module(module: nn.Module) -> bool:
    """A fused experts module (qlens ``QuantExperts``, HF ``FP8Experts``, float HF experts)."""
    return hasattr(module, "num_experts") and not hasattr(module, "in_features")


def float_experts_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Memory of the float gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` weights of ``module``."""
    m: Any = module
    hidden = getattr(m, "hidden_dim", None) or getattr(m, "hidden_size", None)
    inner = getattr(m, "intermediate_dim", None) or getattr(m, "intermediate_size", None)
    if hidden is None or inner is None:
        raise ValueError(
            f"{type(module).__name__} does not say its hidden/intermediate sizes "
            "(hidden_dim, intermediate_dim); qlens cannot plan its float copy"
        )
    return 3 * int(m.num_experts) * int(hidden) * int(inner) * dtype.itemsize


def hf_experts_class(model: nn.Module, parent: nn.Module) -> type[nn.Module]:
    """The float experts class defined next to ``parent`` (the MoE block) in its modeling file."""
    for owner in (type(parent), type(model)):
        module = sys.modules.get(owner.__module__)
        found = [
            value
            for name, value in vars(module).items()
            if name.endswith("Experts")
            and isinstance(value, type)
            and issubclass(value, nn.Module)
            and value.__module__ == owner.__module__
        ]
        if len(found) == 1:
            return found[0]
    raise NotImplementedError(
        f"qlens cannot find the float experts class of {type(model).__name__} (looked for one "
        f"*Experts class in {type(parent).__module__}); dequantize the experts with "
        "qlens.dequantize(module) and load them into a float copy of the model instead"
    )


def _relayout(value: Tensor, source: GateUpLayout, target: GateUpLayout, dim: int) -> Tensor:
    """Rearrange fused gate/up rows along ``dim`` (negative) from ``source`` to ``target``."""
    if source == target:
        return value
    gate, up = split_gate_up(value, source, dim)
    if target == "halves":
        return torch.cat([gate, up], dim=dim)
    return torch.stack([gate, up], dim=dim).flatten(dim - 1, dim)  # g0, u0, g1, u1, ...


def float_experts(
    model: nn.Module,
    name: str,
    *,
    dtype: torch.dtype,
    operation: str,
    layout: GateUpLayout,
    stored_in_out: bool,
) -> nn.Module:
    """A float experts module of the family's HF class with the dequantized weights of the
    quantized experts module at ``name``.

    ``layout`` and ``stored_in_out`` describe the float HF class (from the bridge adapter; the
    module's own ``is_concatenated`` / ``is_transposed`` flags win).
    """
    quantized = model.get_submodule(name)
    parent = model.get_submodule(name.rpartition(".")[0])
    weights = read_experts(quantized, operation=operation, owner=model, dequantize=True)
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        new = hf_experts_class(model, parent)(config)
    concatenated = getattr(new, "is_concatenated", None)  # the module's own flag wins
    if concatenated is not None:
        layout = "halves" if concatenated else "interleaved"
    gate_up = _relayout(weights.gate_up, weights.layout, layout, dim=-2)
    down = weights.down
    in_out = bool(getattr(new, "is_transposed", stored_in_out))
    if in_out:
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    tensors = {"gate_up_proj": gate_up, "down_proj": down}
    if weights.gate_up_bias is not None:
        tensors["gate_up_proj_bias"] = _relayout(weights.gate_up_bias, weights.layout, layout, -1)
    if weights.down_bias is not None:
        tensors["down_proj_bias"] = weights.down_bias
    for key, value in tensors.items():
        current = getattr(new, key, None)
        if not isinstance(current, Tensor) or tuple(current.shape) != tuple(value.shape):
            shape = None if not isinstance(current, Tensor) else list(current.shape)
            raise NotImplementedError(
                f"qlens cannot rebuild {name} as a float {type(new).__name__}: its {key} is "
                f"{shape}, the dequantized weights give {list(value.shape)}"
            )
        replace_tensor(new, key, value.detach().to(dtype).contiguous())
    left = [item.name for item in unreadable_weights(new)]  # tensors still on the meta device
    if left:
        raise NotImplementedError(
            f"qlens cannot rebuild {name} as a float {type(new).__name__}: the quantized module "
            f"has no values for {', '.join(left)}"
        )
    return new.train(quantized.training)
