"""Run Hugging Face quantized modules whose own forward cannot run here through qlens' forward.

transformers' ``FP8Linear``/``FP8Experts`` call CUDA kernels (DeepGEMM or a hub kernel),
``HiggsLinear`` needs a FLUTE workspace tuned on a GPU, GPT-OSS ``Mxfp4GptOssExperts`` need
the triton_kernels hub package, and torchao's int4 weights need mslk, tinygemm (CUDA) or an
XPU/NPU. :func:`reroute_quantized_modules` replaces the forward of such
modules (on the instance; the module, its tensors and its path stay as they are, so hook names
and ``save_pretrained`` are unaffected) with qlens' forward: the module is read into payloads by
``qlens.quant.adopt.adopt_module`` (when rerouted, or at its first call if its tensors are still
on the meta device; again whenever they change) and each matmul runs on qlens' Triton kernel or
its torch reference. Rerouting is always logged (a WARNING summary, one INFO line per module): the
numerics become those of a weight-only matmul on the exact dequantized weight (static FP8
activation scales, for instance, are not applied; ``qlens.set_w8a8`` has block-FP8 linears
quantize their activations per token and K block, as ``FP8Linear`` does on a GPU).
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import operator
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from qlens.kernels.experts import experts_plan_for
from qlens.kernels.gate_rule import GateRule
from qlens.kernels.op_payloads import offer_to_ops
from qlens.kernels.ops import compiled_linear
from qlens.kernels.plan import plan_for, require_w8a8
from qlens.modules.dispatch import (
    check_payload_device,
    experts_w8a8_groups,
    fused_experts_forward,
)
from qlens.modules.expert_gate import ExpertGate
from qlens.modules.traced_experts import traced_experts_forward
from qlens.quant import adopt
from qlens.quant.adopt.compressed_tensors import (
    detach_decompress_hook,
    is_compressed_tensors_module,
    reattach_decompress_hook,
)
from qlens.quant.adopt.torchao_int4 import torchao_int4_forward_problem
from qlens.quant.payload import QuantPayload
from qlens.quant.payload_spec import PayloadSpec

logger = logging.getLogger(__name__)

_FP8_KERNELS = "CUDA kernels (DeepGEMM or the kernels-community/finegrained-fp8 hub kernel)"


def own_forward_problem(module: nn.Module) -> str | None:
    """Why ``module``'s own forward cannot run here, or None when it can (or is not recognised)."""
    cls = type(module).__name__
    if cls in ("FP8Linear", "FP8Experts"):
        weight = getattr(module, "weight", None) if cls == "FP8Linear" else _first_weight(module)
        if not isinstance(weight, Tensor) or weight.element_size() > 1:
            return None
        if weight.device.type != "cuda":
            return f"its forward needs {_FP8_KERNELS}; the weight is on {weight.device}"
        from transformers.utils import is_kernels_available

        if not is_kernels_available():
            return f"its forward needs {_FP8_KERNELS}; the `kernels` package is not installed"
        return None
    if cls == "HiggsLinear":
        if getattr(module, "workspace", None) is None:
            return "its FLUTE workspace is not set (HIGGS needs a GPU-tuned workspace and kernel)"
        return None
    if is_compressed_tensors_module(module):
        return (
            "compressed-tensors decompresses it in place into a float weight on the model's "
            "first forward; qlens keeps it packed"
        )
    if cls == "Mxfp4GptOssExperts":
        from transformers.integrations import mxfp4

        if getattr(mxfp4, "triton_kernels_hub", None) is None:
            return "its forward needs the gpt-oss-triton-kernels hub kernel, which is not loaded"
        if isinstance(getattr(module, "gate_up_proj", None), Tensor):
            return "its MXFP4 blocks are plain tensors, not swizzled for the triton_kernels matmul"
        return None
    return torchao_int4_forward_problem(module)


def reroute_quantized_modules(
    model: nn.Module, keep: Sequence[str] | None = None, *, force: bool = False
) -> list[str]:
    """Give every HF quantized module that cannot run here qlens' forward; return their paths.

    Args:
        model: any module tree (a transformers model, usually).
        keep: glob patterns (``fnmatch``) on module paths whose own forward is kept.
        force: also reroute quantized modules whose own forward could run (to use qlens'
            kernels instead of the library's).
    """
    from qlens.quant.adopt import is_quantized_module

    patterns = tuple(keep or ())
    rerouted: list[str] = []
    for name, module in model.named_modules():
        if _is_rerouted(module):
            continue
        problem = own_forward_problem(module)
        if problem is None and not (force and is_quantized_module(module)):
            continue
        if not is_quantized_module(module):
            logger.warning(
                "%s (%s): %s, and qlens cannot read it", name, type(module).__name__, problem
            )
            continue
        kept = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        if kept is not None:
            logger.info("kept the own forward of %s (matches keep pattern %r)", name, kept)
            continue
        _reroute(module)
        _watch_assignments()
        if _materialized(module):  # so a compiled graph traced before any call reads it
            _adopted(module)
        rerouted.append(name)
        reason = problem or "forced"
        logger.info("rerouted %s (%s) through qlens: %s", name, type(module).__name__, reason)
    for name, module in model.named_modules():
        if type(module).__name__ == "Mxfp4GptOssMLP" and _is_rerouted(module.experts):
            if not _is_rerouted(module):
                module.forward = types.MethodType(_mxfp4_mlp_forward, module)
                rerouted.append(name)
                logger.info("rerouted %s (Mxfp4GptOssMLP): routing by its router module", name)
    if rerouted and detach_decompress_hook(model):
        logger.info("detached compressed-tensors' decompress-on-first-forward hook")
    if rerouted:
        logger.warning(
            "qlens rerouted %d quantized modules through its own forward (exact dequantized "
            "weights, weight-only matmul): %s",
            len(rerouted),
            ", ".join(rerouted[:8]) + (", ..." if len(rerouted) > 8 else ""),
        )
    return rerouted


def restore_own_forward(model: nn.Module) -> list[str]:
    """Undo :func:`reroute_quantized_modules`; return the paths restored."""
    restored = []
    for name, module in model.named_modules():
        if _is_rerouted(module):
            own = module.__dict__.get("_qlens_own_forward")
            del module.forward
            del module._apply
            if own is not None:  # an instance forward the library had set (compressed-tensors)
                module.forward = own
                del module._qlens_own_forward
            restored.append(name)
    reattach_decompress_hook(model)
    return restored


_REROUTED_FORWARDS: set[Callable] = set()


def _is_rerouted(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) in _REROUTED_FORWARDS


def _first_weight(module: nn.Module) -> Tensor | None:
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        value = getattr(module, name, None)
        if isinstance(value, Tensor):
            return value
    return None


def _materialized(module: nn.Module) -> bool:
    """Whether the module's own tensors hold values (none on the meta device)."""
    tensors = _own_tensors(module)
    return bool(tensors) and not any(t.is_meta for t in tensors)


def _reroute(module: nn.Module) -> None:
    own = module.__dict__.get("forward")
    if own is not None:
        module._qlens_own_forward = own
    module._apply = types.MethodType(_apply_then_adopt, module)  # type: ignore[method-assign]
    if _first_weight(module) is not None or type(module).__name__ == "Mxfp4GptOssExperts":
        module.forward = types.MethodType(_experts_forward, module)
        if _has_gate(module):
            _gate_fn(module)  # now, eagerly: a compiled first forward cannot run its probe
    else:
        module.forward = types.MethodType(_linear_forward, module)


@functools.cache
def _watch_assignments() -> None:
    """Have every parameter or buffer assigned to a rerouted module (``module.weight = ...``,
    ``load_state_dict(assign=True)``) read at once, so compiled graphs read the new tensor."""
    from torch.nn.modules import module as module_hooks

    module_hooks.register_module_parameter_registration_hook(_adopt_assigned("_parameters"))
    module_hooks.register_module_buffer_registration_hook(_adopt_assigned("_buffers"))


def _adopt_assigned(kind: str) -> Callable[[nn.Module, str, Tensor | None], None]:
    def hook(module: nn.Module, name: str, value: Tensor | None) -> None:
        if value is None or not _is_rerouted(module):
            return
        getattr(module, kind)[name] = value  # torch stores it right after its hooks
        try:
            _read_again(module)
        except (ValueError, TypeError, RuntimeError):
            # Maybe one of several tensors replaced in turn: read (and checked, raising if
            # still wrong) at the next forward instead.
            _forget_adoption(module)

    return hook


def _read_again(module: nn.Module) -> None:
    """Adopt the module's current tensors, or forget the adoption while any is on meta."""
    if _materialized(module):
        _adopted(module)
    else:
        _forget_adoption(module)


def _forget_adoption(module: nn.Module) -> None:
    _ADOPTED.pop(module, None)
    for name in (_TRACED, _SOURCES):
        module.__dict__.pop(name, None)


def _apply_then_adopt(
    self: nn.Module, fn: Callable[[Tensor], Tensor], recurse: bool = True
) -> nn.Module:
    """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``...), then the module's tensors
    read again: conversions may keep the tensor objects and replace their data, which no
    compiled graph guard sees."""
    out = nn.Module._apply(self, fn, recurse)
    _read_again(self)
    return out


# Payloads adopted from a module, rebuilt whenever one of the module's tensors is replaced,
# moved or modified in place. Weak keys: the cache never outlives (or is copied with) a module.
_PLAIN = (int, float, str, bool, type(None), dict, nn.Module)
_MISSING = object()


@dataclass(frozen=True)
class _Adoption:
    """What a module's payloads were read from: its own tensors with their data pointers and
    version counters (bumped by in-place edits), and its other non-plain attributes (e.g.
    triton_kernels wrappers, quantization states) by name and identity."""

    tensors: tuple[Tensor, ...]
    stamps: tuple[tuple[int, int], ...]
    holders: tuple[tuple[str, object], ...]
    payloads: QuantPayload | dict[str, QuantPayload]

    def current(self, module: nn.Module) -> bool:
        """Whether ``module`` still holds exactly these tensors, unmodified, and holders: a few
        identity and counter comparisons a call."""
        tensors = _own_tensors(module)
        if len(tensors) != len(self.tensors):
            return False
        # Tensor subclasses (bitsandbytes' Params4bit) would route each read through their
        # __torch_function__, several microseconds apiece.
        with torch._C.DisableTorchFunctionSubclass():
            for tensor, kept, (pointer, version) in zip(
                tensors, self.tensors, self.stamps, strict=True
            ):
                if tensor is not kept or tensor._version != version or tensor.data_ptr() != pointer:
                    return False
        attributes = module.__dict__
        return all(attributes.get(name, _MISSING) is value for name, value in self.holders)


_ADOPTED: weakref.WeakKeyDictionary[nn.Module, _Adoption] = weakref.WeakKeyDictionary()


def _own_tensors(module: nn.Module) -> list[Tensor]:
    """The module's own parameters and buffers (not its children's)."""
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _adopted(module: nn.Module) -> QuantPayload | dict[str, QuantPayload]:
    cached = _ADOPTED.get(module)
    if cached is not None and cached.current(module):
        return cached.payloads
    tensors = tuple(_own_tensors(module))
    holders = tuple(
        (k, v) for k, v in vars(module).items() if k not in _KEPT and not isinstance(v, _PLAIN)
    )
    payloads = adopt.adopt_module(module)
    with torch._C.DisableTorchFunctionSubclass():
        stamps = tuple((t.data_ptr(), t._version) for t in tensors)
    _ADOPTED[module] = _Adoption(tensors, stamps, holders, payloads)
    module.__dict__[_TRACED] = _op_arguments(payloads)
    module.__dict__[_SOURCES] = tensors
    return payloads


# The adopted payloads as the qlens:: ops take them (tensors, spec key), kept on the module by
# each adoption: what a forward traced by torch.compile reads (the tensors become graph inputs).
_TRACED = "_qlens_adopted_for_ops"
OpArguments = tuple[list[Tensor], str, int]  # tensors, spec key, leading size


def _op_arguments(
    payloads: QuantPayload | dict[str, QuantPayload],
) -> OpArguments | dict[str, OpArguments]:
    def one(p: QuantPayload) -> OpArguments:
        tensors, key = list(p.tensors().values()), PayloadSpec.of(p).key
        offer_to_ops(p, tensors, key)
        return tensors, key, int(p.shape[0])

    return one(payloads) if isinstance(payloads, QuantPayload) else {
        name: one(p) for name, p in payloads.items()
    }  # fmt: skip


# The module's own tensors the kept op arguments were read from.
_SOURCES = "_qlens_adopted_from"


def _traced_adoption(module: nn.Module) -> Any:
    """The kept op arguments (adopting first when no eager call did yet), checked to come from
    the module's current tensors. The graph reads them afresh on every call, and every
    adoption replaces them (an eager call after a change, ``.to()``); reading the module's
    tensors here also has dynamo guard them, so a tensor replaced after compiling retraces."""
    kept = module.__dict__.get(_TRACED)
    if kept is None:
        _adopted(module)
        kept = module.__dict__[_TRACED]
    sources, current = module.__dict__[_SOURCES], _own_tensors(module)
    if len(sources) != len(current) or any(map(operator.is_not, sources, current)):
        raise RuntimeError(
            f"the tensors of this rerouted {type(module).__name__} were replaced since qlens "
            "read them, so the compiled graph cannot read them without checking them first: "
            "run one forward without torch.compile (it reads them again), then the compiled one; "
            "assign tensors as attributes (module.weight = ...), which qlens reads at once"
        )
    return kept


def _linear_forward(self: Any, x: Tensor) -> Tensor:
    parameters = self._parameters  # a registered bias without nn.Module.__getattr__'s cost
    bias = parameters["bias"] if "bias" in parameters else getattr(self, "bias", None)
    w8a8 = self.__dict__.get(_W8A8, False)
    if torch.compiler.is_compiling():
        tensors, key, _ = _traced_adoption(self)
        return compiled_linear(x, tensors, key, bias, w8a8)
    payload = _adopted(self)
    if not isinstance(payload, QuantPayload):
        raise TypeError(f"adopting {type(self).__name__} gave {sorted(payload)}, not one payload")
    plan = _kept_plans(self, payload, payload, x, lambda: plan_for(payload, x.device, w8a8=w8a8))
    return plan(x, bias)


def rerouted_payloads(module: nn.Module) -> QuantPayload | dict[str, QuantPayload] | None:
    """What a rerouted module runs (adopted now if no forward did yet): a linear's payload, or
    the experts' payloads by projection; None for a module that is not rerouted."""
    forward = module.__dict__.get("forward")
    if getattr(forward, "__func__", None) not in (_linear_forward, _experts_forward):
        return None  # not rerouted, or a block whose experts are (GPT-OSS' MLP)
    return _adopted(module)


def set_rerouted_w8a8(module: nn.Module, enabled: bool) -> None:
    """Have a rerouted linear or experts module quantize its activations to FP8 too (W8A8),
    or not; raises when one of its weights cannot (``qlens.kernels.plan.w8a8_problem``)."""
    payloads = rerouted_payloads(module)
    if payloads is None:
        raise ValueError(f"{type(module).__name__} is not a rerouted module")
    if isinstance(payloads, QuantPayload):
        if enabled:
            require_w8a8(payloads.format, payloads.shape)
        module.__dict__[_W8A8] = bool(enabled)
        module.__dict__.pop(_PLANS, None)  # the kept plan ran the other numerics
        return
    first = payloads["gate_up_proj" if "gate_up_proj" in payloads else "up_proj"]
    groups = experts_w8a8_groups(first, payloads["down_proj"]) if enabled else None
    module.__dict__[_W8A8] = groups


def _experts_forward(
    self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    if torch.compiler.is_compiling():
        return _traced_experts(self, hidden_states, top_k_index, top_k_weights)
    payloads = _adopted(self)
    if not isinstance(payloads, dict):
        raise TypeError(f"adopting {type(self).__name__} gave one payload, not one per projection")
    has_gate = "gate_up_proj" in payloads
    first = payloads["gate_up_proj" if has_gate else "up_proj"]
    down = payloads["down_proj"]
    device = hidden_states.device
    first_plan, down_plan = _kept_plans(
        self, payloads, first, hidden_states,
        lambda: (experts_plan_for(first, device), experts_plan_for(down, device)),
    )  # fmt: skip
    first_bias = getattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", None)
    down_bias = getattr(self, "down_proj_bias", None)
    activate, rule = _gate_fn(self) if has_gate else (self.act_fn, None)
    return fused_experts_forward(
        hidden_states, top_k_index, top_k_weights, first_plan, down_plan, first_bias, down_bias,
        activate, self.__dict__.get(_W8A8), rule,
    )  # fmt: skip


# The launch plans of the adopted payloads on the device of the last input, kept on the module
# with the adoption they belong to: a forward reaches them with two comparisons.
_PLANS = "_qlens_adopted_plans"
T = TypeVar("T")
_GATE = "_qlens_gate"
# FP8 activations (``set_rerouted_w8a8``): a linear's flag, or the experts' activation blocks.
_W8A8 = "_qlens_w8a8"
# What qlens keeps on the module itself: not the adoption.
_KEPT = (_TRACED, _SOURCES, _PLANS, _GATE, _W8A8, "_apply")


def _kept_plans(
    module: nn.Module, adoption: object, payload: QuantPayload, x: Tensor, build: Callable[[], T]
) -> T:
    """``build()``'s plans, kept until the module adopts its tensors again or ``x`` comes on
    another device (then checked against ``payload``'s device first)."""
    kept = module.__dict__.get(_PLANS)
    if kept is not None and kept[0] is adoption and kept[1] == x.device:
        return cast(T, kept[2])
    check_payload_device(payload, x, type(module).__name__)
    plans = build()
    module.__dict__[_PLANS] = (adoption, x.device, plans)
    return plans


def _traced_experts(
    self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    kept = _traced_adoption(self)
    has_gate = "gate_up_proj" in kept
    activate, rule = _gate_fn(self) if has_gate else (self.act_fn, None)
    down_tensors, down_key, _ = kept["down_proj"]
    return traced_experts_forward(
        hidden_states, top_k_index, top_k_weights, kept["gate_up_proj" if has_gate else "up_proj"],
        (down_tensors, down_key),
        getattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", None),
        getattr(self, "down_proj_bias", None),
        activate, self.__dict__.get(_W8A8), rule,
    )  # fmt: skip


def _has_gate(module: nn.Module) -> bool:
    """Whether the experts module combines gate|up rows (its own ``_apply_gate``, or GPT-OSS'
    ``Mxfp4GptOssExperts``), not an up projection alone."""
    if type(module).__name__ == "Mxfp4GptOssExperts":
        return True
    return getattr(module, "_apply_gate", None) is not None and hasattr(module, "gate_up_proj")


def _gate_fn(module: Any) -> tuple[Callable[[Tensor], Tensor], GateRule | None]:
    """The module's gating and its fused form (``ExpertGate.kernel_rule``, or ``None`` where
    the fused MoE decode cannot compute it), built when the module is rerouted (its probe runs
    eagerly) and kept on it."""
    gate = module.__dict__.get(_GATE)
    if gate is None:
        own = getattr(module, "_apply_gate", None)
        if own is not None:
            gate = (own, _SILU_GATE.kernel_rule if _computes_silu_gate(own) else None)
        else:  # Mxfp4GptOssExperts: the hub kernel fuses GPT-OSS' interleaved, clamped SwiGLU
            rule = ExpertGate("interleaved", "clamped_swiglu", module.alpha, module.limit)
            gate = (rule.apply, rule.kernel_rule)
        module.__dict__[_GATE] = gate
    return gate


_SILU_GATE = ExpertGate("stacked", "silu")


def _computes_silu_gate(apply_gate: Callable[[Tensor], Tensor]) -> bool:
    """Whether a module's own gating (transformers' ``FP8Experts._apply_gate``, whose clamps,
    softcaps and activation follow the config) is ``silu(gate) * up`` on ``[gate; up]`` rows:
    checked once, exactly, on values from -64 to 64 that a clamp, a softcap or another
    activation would change."""
    values = torch.linspace(-64.0, 64.0, 257)
    probe = torch.cat([values[None], values.flip(0)[None]], dim=1)  # [1, 2 * 257]
    return torch.equal(apply_gate(probe), _SILU_GATE.apply(probe))


def _mxfp4_mlp_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """``Mxfp4GptOssMLP.forward`` with the routing done by the router module, not the hub kernel."""
    batch_size = hidden_states.shape[0]
    flat = hidden_states.reshape(-1, self.router.hidden_dim)
    router_logits, router_scores, router_indices = self.router(flat)
    out = self.experts(flat, router_indices, router_scores)
    return out.reshape(batch_size, -1, self.router.hidden_dim), router_logits


_REROUTED_FORWARDS.update({_linear_forward, _experts_forward, _mxfp4_mlp_forward})
