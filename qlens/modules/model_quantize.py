"""``qlens.quantize``: swap a model's linear layers and fused experts for quantized modules.

Copy or in place: by default the input is left untouched and a new model is returned (a deep
copy that shares nothing with the input; the float weights of the layers being quantized are not
copied, only read). ``inplace=True`` swaps the modules inside the given model and returns it. A
:class:`~qlens.Bridge` input returns a new Bridge (same tokenizer) over the quantized model; module
paths and therefore every hook name stay the same. With ``inplace=True`` and a Bridge, the model
inside it is modified and a new Bridge is returned: the old one's hook sites still point at the
replaced float modules, so use the returned Bridge.

Eligible modules: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2) with float weights, and
fused experts modules (``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` parameters:
Mixtral, Qwen3-MoE, GPT-OSS...). Skipped, with the reason logged at INFO: modules matching a
``skip`` pattern (by default the unembedding ``lm_head`` and anything named like an
embedding), weights that are not float (already quantized), experts whose gating qlens does not
reproduce. Shapes: every scheme takes any ``[out, in]`` (partial last blocks or groups are
allowed); if the quantizer rejects a weight, ``quantize`` raises naming the module, so nothing is
left half-quantized silently.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.hf_experts import FusedExpertWeights, is_fused_experts, read_fused_experts
from qlens.modules.siblings import group_siblings
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight, quantizing_codecs

logger = logging.getLogger(__name__)

DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "*.lm_head", "embed_out", "*embed*")


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "SCHEMES":  # the registered quantize schemes, read on every access
        return tuple(quantizing_codecs())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class _Plan:
    name: str
    module: nn.Module
    kind: str  # "linear" | "conv1d" | "experts"


def quantize(
    model_or_bridge: Any,
    scheme: str,
    *,
    skip: Sequence[str] | None = None,
    group_size: int | None = None,
    asymmetric: bool = False,
    scale_dtype: str | None = None,
    inplace: bool = False,
) -> Any:
    """Quantize every eligible linear layer and fused experts module with ``scheme``.

    Args:
        model_or_bridge: an ``nn.Module`` (typically a transformers causal LM) or a qlens Bridge.
        scheme: a quantize scheme, one of :data:`SCHEMES` (``fp8-block``, ``int4``...).
        skip: glob patterns (``fnmatch``) on module paths to leave unquantized; ``None`` means
            :data:`DEFAULT_SKIP` (unembedding and embeddings). A list replaces the defaults:
            pass ``[*DEFAULT_SKIP, "*.q_proj"]`` to extend them.
        group_size: group size along the input dim for ``int4``/``int8`` (the quantizer's
            default when ``None``); other schemes have fixed blocks.
        asymmetric: ``int4``/``int8`` with integer zero points (``(q - z) * s``) instead of
            symmetric codes.
        scale_dtype: ``"e8m0"`` for power-of-two ``fp8-block`` scales (fp32 by default);
            ``"bf16"``/``"fp16"`` for integer scales. See ``qlens.quant.quantize.SCHEMES``.
        inplace: swap inside the given model instead of returning a new one.

    Returns:
        The quantized model, or a new Bridge over it when a Bridge was given.
    """
    schemes = quantizing_codecs()
    if scheme not in schemes:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {list(schemes)}")
    if group_size is not None and "group_size" not in schemes[scheme].quantize_options:
        grouped = "/".join(s for s, c in schemes.items() if "group_size" in c.quantize_options)
        raise ValueError(
            f"group_size applies to the {grouped} schemes only; {scheme!r} has a fixed block"
        )
    options: dict[str, Any] = {"asymmetric": asymmetric, "scale_dtype": scale_dtype}
    if group_size is not None:
        options["group_size"] = group_size
    _check_options(scheme, options)
    bridge = None
    model = model_or_bridge
    if not isinstance(model_or_bridge, nn.Module):
        bridge = model_or_bridge
        model = getattr(bridge, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"quantize expects an nn.Module or a qlens Bridge; got {type(model_or_bridge).__name__}"
            )
    patterns = tuple(DEFAULT_SKIP if skip is None else skip)
    plans = plan_quantization(model, patterns)
    if not inplace:
        model = _copy_without_quantized_weights(model, plans)
        plans = [_Plan(p.name, model.get_submodule(p.name), p.kind) for p in plans]
    before = after = 0
    for plan in plans:
        new_module = quantized_module(plan, scheme, options)
        before += sum(t.numel() * t.element_size() for t in plan.module.parameters())
        after += sum(t.numel() * t.element_size() for t in new_module.state_dict().values())
        model.set_submodule(plan.name, new_module)
        logger.info("quantized %s (%s) -> %s", plan.name, plan.kind, new_module.extra_repr())
    logger.info(
        "qlens.quantize(%s): swapped %d modules, weights %.2f MB -> %.2f MB",
        scheme,
        len(plans),
        before / 2**20,
        after / 2**20,
    )
    if bridge is None:
        group_siblings(model)
        return model
    # A new Bridge groups the siblings itself.
    return type(bridge)(model, tokenizer=getattr(bridge, "tokenizer", None))


def plan_quantization(
    model: nn.Module, patterns: tuple[str, ...], *, on_meta: bool = False
) -> list[_Plan]:
    """The modules ``quantize`` swaps, in module order (``on_meta``: weights not loaded yet)."""
    from transformers.pytorch_utils import Conv1D

    plans: list[_Plan] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, (QuantLinear, QuantExperts)):
            continue
        if isinstance(module, (nn.Linear, Conv1D)):
            kind = "linear" if isinstance(module, nn.Linear) else "conv1d"
        elif is_fused_experts(module):
            kind = "experts"
        else:
            continue
        matched = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        if matched is not None:
            logger.info("kept %s unquantized: matches skip pattern %r", name, matched)
            continue
        reason = _ineligible(module, kind, on_meta)
        if reason is not None:
            logger.info("kept %s unquantized: %s", name, reason)
            continue
        plans.append(_Plan(name, module, kind))
        taken.append(name)
    return plans


def _ineligible(module: nn.Module, kind: str, on_meta: bool) -> str | None:
    if kind == "experts":
        read = read_fused_experts(module)
        return read if isinstance(read, str) else None
    weight: torch.Tensor = getattr(module, "weight")  # noqa: B009 (nn.Linear or Conv1D)
    if not (weight.is_floating_point() and weight.element_size() >= 2):
        return f"its weight is {weight.dtype}, not a float (already quantized?)"
    if weight.device.type == "meta" and not on_meta:
        return "its weight is on the meta device (never materialized)"
    return None


def _copy_without_quantized_weights(model: nn.Module, plans: list[_Plan]) -> nn.Module:
    """Deep copy of ``model`` that skips copying the float weights about to be quantized.

    Those weights are shared with the input only until their modules are replaced; a weight also
    used by a module that stays (e.g. an embedding tied to a quantized unembedding) is copied.
    """
    planned = {id(plan.module) for plan in plans}
    kept = {
        id(t)
        for module in model.modules()
        if id(module) not in planned
        for t in module.parameters(recurse=False)
    }
    memo: dict[int, Any] = {}
    for plan in plans:
        for tensor in plan.module.parameters():
            if id(tensor) not in kept:
                memo[id(tensor)] = tensor
    return copy.deepcopy(model, memo)


def _check_options(scheme: str, options: dict[str, Any]) -> None:
    """Raise the quantizer's own error for options the scheme does not take, before any work."""
    quantize_weight(torch.ones(1, 32), scheme, **options)


def _quantize(
    weight: torch.Tensor, scheme: str, options: dict[str, Any], name: str
) -> QuantPayload:
    try:
        return quantize_weight(weight.detach().contiguous(), scheme, **options)
    except ValueError as error:
        raise ValueError(
            f"cannot quantize {name} (weight {list(weight.shape)}) with {scheme!r}: {error}. "
            f"Leave it unquantized with skip=[..., {name!r}]"
        ) from error


def quantized_module(plan: _Plan, scheme: str, options: dict[str, Any]) -> nn.Module:
    """The QuantLinear / QuantExperts replacing ``plan.module``, quantized with ``scheme``."""
    module: Any = plan.module
    if plan.kind in ("linear", "conv1d"):
        weight = module.weight if plan.kind == "linear" else module.weight.t()
        payload = _quantize(weight, scheme, options, plan.name)
        bias = module.bias.detach() if module.bias is not None else None
        return QuantLinear(payload, bias)
    experts = read_fused_experts(module)
    assert isinstance(experts, FusedExpertWeights)  # checked when planning
    gate_up = _quantize(experts.gate_up, scheme, options, f"{plan.name}.gate_up_proj")
    down = _quantize(experts.down, scheme, options, f"{plan.name}.down_proj")
    return QuantExperts(gate_up, down, experts.gate, experts.gate_up_bias, experts.down_bias)
