"""The one guarded path by which qlens reads weights as float tensors.

Every weight-space feature (accessors, circuits, processing, analyses) reads weights through
:func:`read_weight`, :func:`read_tensor` or :func:`read_experts`. A readable float weight comes
back as it is; anything else raises through :func:`qlens.quant.guards.require_readable_weight`
naming the operation, unless the caller opted into dequantization, either with
``dequantize=True`` or inside ``with dequantized(bridge):``. Then the float matrix is rebuilt by
``qlens.dequantize`` (qlens QuantLinear/QuantExperts, HF quantized modules) or by the tensor
subclass' own ``dequantize()`` (torchao, optimum-quanto).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

from jaxtyping import Float
from torch import Tensor, nn

from qlens.quant.guards import (
    quantization_method,
    require_readable_weight,
    unreadable_weight_reason,
    weight_problem,
)
from qlens.quant.libraries import library_of

# Owners (bridges or models) inside a `dequantized(...)` block; ALL means every owner.
_ALL = object()
_OPTED_IN: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar(
    "qlens_dequantize_opt_in", default=()
)

GateUpLayout = Literal["halves", "interleaved"]


@contextlib.contextmanager
def dequantized(bridge: Any = None) -> Iterator[Any]:
    """Within the block, weight reads of ``bridge`` (or of every model when None) dequantize.

    Quantized weights are rebuilt in float by ``qlens.dequantize`` on each read; nothing in the
    model changes. Yields ``bridge``.
    """
    token = _OPTED_IN.set((*_OPTED_IN.get(), _ALL if bridge is None else bridge))
    try:
        yield bridge
    finally:
        _OPTED_IN.reset(token)


def dequantize_opted_in(owner: Any, dequantize: bool = False) -> bool:
    """Whether reads on behalf of ``owner`` may dequantize (argument or ``dequantized`` block)."""
    if dequantize:
        return True
    for opted in _OPTED_IN.get():
        if opted is _ALL or opted is owner:
            return True
        if owner is not None and getattr(opted, "model", None) is owner:
            return True
        if owner is not None and getattr(owner, "model", None) is opted:
            return True
    return False


def _is_meta(weight: Any) -> bool:
    return isinstance(weight, Tensor) and weight.device.type == "meta"


def _beyond_dequantization(weight: Any) -> bool:
    """Unreadable for a reason dequantization cannot fix (meta, uninitialized, complex, numpy)."""
    problem = weight_problem(weight)
    return problem is not None and not problem.quantized


def is_payload_module(module: nn.Module) -> bool:
    """A qlens QuantLinear / QuantExperts (weights held as payload buffers)."""
    from qlens.modules.payload_buffers import PayloadModule

    return isinstance(module, PayloadModule)


def is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def stored_codes(module: nn.Module) -> Any:
    """The tensor (or object) a module keeps its weight in, as stored."""
    if is_payload_module(module):
        holder = cast(Any, module)
        specs = holder.payload_specs()
        prefix = "weight" if "weight" in specs else next(iter(specs))
        return holder.payload_for(prefix).data
    from qlens.quant.adopt.tensor_subclass import is_unfrozen_quanto

    if is_unfrozen_quanto(module):  # its forward uses the quantized weight, not the float one
        return cast(Any, module).qweight
    # HQQLinear keeps a placeholder float `weight` next to its packed `W_q`.
    for name in ("W_q", "weight", "weight_packed", "qweight"):
        if name in module._parameters or name in module._buffers or hasattr(module, name):
            return getattr(module, name)
    return None


def method_owner(module: nn.Module, owner: Any) -> Any:
    """What the guard reads the quantization method from: the owner's config, else qlens' format."""
    config = getattr(owner, "config", None)
    if config is None and owner is not None:
        config = getattr(getattr(owner, "model", None), "config", None)
    if quantization_method(config):
        return config
    if is_payload_module(module):
        specs = cast(Any, module).payload_specs()
        formats = sorted({spec.format.name for spec in specs.values()})
        return {"quant_method": f"qlens {'/'.join(formats)} payload ({type(module).__name__})"}
    if is_hf_quantized(module):  # no config names it (e.g. quantized with the library's own API)
        library = library_of(module) or type(module).__module__.split(".")[0]
        return {"quant_method": f"{library} {type(module).__name__}"}
    return owner


def _dequantize_module(module: nn.Module) -> Tensor | dict[str, Tensor]:
    from qlens.quant.dequantize import dequantize

    holder = cast(Any, module)
    if is_payload_module(module) and not hasattr(module, "payload"):
        return {prefix: dequantize(holder.payload_for(prefix)) for prefix in holder.payload_specs()}
    return dequantize(module)


def has_own_dequantize(weight: object) -> bool:
    """A tensor subclass of a library whose ``dequantize()`` rebuilds the float weight."""
    return isinstance(weight, Tensor) and library_of(weight) in ("torchao", "optimum.quanto")


def _dequantize_tensor(weight: Any, operation: str, reason: str) -> Tensor:
    from qlens.quant.payload import QuantPayload

    if isinstance(weight, QuantPayload):
        from qlens.quant.dequantize import dequantize

        return dequantize(weight)
    # Only the quantized tensor subclasses of known libraries (torchao, optimum-quanto) carry an
    # exact dequantize(); others (bitsandbytes' Int8Params) inherit torch.Tensor.dequantize,
    # which on integer codes only casts them.
    own = getattr(weight, "dequantize", None)
    if has_own_dequantize(weight) and not _is_meta(weight) and callable(own):
        try:
            value = own()
        except (RuntimeError, NotImplementedError, TypeError) as error:
            raise NotImplementedError(
                f"qlens cannot {operation}: {reason}, and its own dequantize() failed: {error}"
            ) from error
        if isinstance(value, Tensor) and value.dtype.is_floating_point:
            return value.float() if value.element_size() < 2 else value
    raise NotImplementedError(
        f"qlens cannot {operation} even with dequantization enabled: {reason}, and qlens knows "
        f"no dequantizer for a {type(weight).__module__}.{type(weight).__qualname__}. Pass the "
        "module holding it (a quantized module qlens.dequantize reads) or convert the model to "
        "float first."
    )


def read_weight(
    source: nn.Module | Tensor | Any,
    *,
    operation: str,
    owner: Any = None,
    dequantize: bool = False,
) -> Tensor:
    """The float weight of a module (``[out, in]`` for linear layers, Conv1D transposed) or tensor.

    ``source`` is a module (nn.Linear, Conv1D, nn.Embedding, a norm, a qlens QuantLinear, an HF
    quantized module) or the weight itself. Unreadable weights raise ``NotImplementedError``
    naming ``operation``, the reason and the quantization method, unless dequantization is
    opted into (``dequantize=True`` or a ``dequantized(owner)`` block); then the float matrix is
    rebuilt exactly by ``qlens.dequantize`` (meta weights still raise: there is nothing to rebuild).
    """
    opted = dequantize_opted_in(owner, dequantize)
    if not isinstance(source, nn.Module):
        return read_tensor(source, operation=operation, owner=owner, dequantize=opted)
    stored = stored_codes(source)
    reason = unreadable_weight_reason(stored)
    if reason is None:
        return stored.T if is_conv1d(source) else stored
    if not opted or _beyond_dequantization(stored):
        require_readable_weight(stored, operation=operation, owner=method_owner(source, owner))
    if is_payload_module(source) or is_hf_quantized(source):
        value = _dequantize_module(source)
        if isinstance(value, dict):
            raise NotImplementedError(
                f"qlens cannot {operation}: {type(source).__name__} holds several weights "
                f"({', '.join(value)}); read them with qlens.weights.read_experts"
            )
        return value
    value = _dequantize_tensor(stored, operation, reason)
    return value.T if is_conv1d(source) else value


def read_tensor(
    weight: Any, *, operation: str, owner: Any = None, dequantize: bool = False
) -> Tensor:
    """A weight tensor (a parameter, a bias, a 3-D experts tensor) if readable, else raise.

    With dequantization opted in, tensor subclasses are rebuilt by their own ``dequantize()``.
    """
    reason = unreadable_weight_reason(weight)
    if reason is None:
        return weight
    if not dequantize_opted_in(owner, dequantize) or _beyond_dequantization(weight):
        require_readable_weight(weight, operation=operation, owner=owner)
    return _dequantize_tensor(weight, operation, reason)


def read_optional(
    module: nn.Module | None,
    name: str,
    *,
    operation: str,
    owner: Any = None,
    dequantize: bool = False,
) -> Tensor | None:
    """``module.<name>`` (e.g. a bias) through the guard, or None when absent."""
    if module is None:
        return None
    value = getattr(module, name, None)
    if value is None:
        return None
    return read_tensor(value, operation=operation, owner=owner, dequantize=dequantize)


def is_hf_quantized(module: nn.Module) -> bool:
    from qlens.quant.adopt import is_quantized_module

    return is_quantized_module(module)


@dataclass
class ExpertWeights:
    """A fused experts module's weights in logical ``[experts, out, in]`` orientation."""

    gate_up: Float[Tensor, "experts two_d_mlp d_model"]
    down: Float[Tensor, "experts d_model d_mlp"]
    layout: GateUpLayout  # how gate and up rows are arranged in gate_up
    gate_up_bias: Float[Tensor, "experts two_d_mlp"] | None
    down_bias: Float[Tensor, "experts d_model"] | None

    def split_gate_up(
        self,
    ) -> tuple[Float[Tensor, "experts d_mlp d_model"], Float[Tensor, "experts d_mlp d_model"]]:
        """(gate, up) rows of ``gate_up``."""
        return split_gate_up(self.gate_up, self.layout, dim=-2)


def split_gate_up(weight: Tensor, layout: GateUpLayout, dim: int) -> tuple[Tensor, Tensor]:
    """Split a fused gate/up tensor along ``dim`` into (gate, up)."""
    if weight.shape[dim] % 2:
        raise ValueError(
            f"a fused gate/up tensor needs an even size along dim {dim}, got {list(weight.shape)}"
        )
    if layout == "halves":
        gate, up = weight.chunk(2, dim=dim)
        return gate, up
    if layout == "interleaved":
        moved = weight.movedim(dim, 0)
        return moved[0::2].movedim(0, dim), moved[1::2].movedim(0, dim)
    raise ValueError(f"unknown gate/up layout {layout!r}; expected 'halves' or 'interleaved'")


def read_experts(
    module: nn.Module,
    *,
    operation: str,
    owner: Any = None,
    dequantize: bool = False,
    layout: GateUpLayout = "halves",
    stored_in_out: bool = False,
) -> ExpertWeights:
    """Every expert's gate_up ``[E, 2*d_mlp, d_model]`` and down ``[E, d_model, d_mlp]``.

    ``layout`` and ``stored_in_out`` describe float HF modules (from the bridge adapter;
    a module's own ``is_transposed``/``is_concatenated`` flags win); quantized modules carry their
    own. Unreadable 3-D tensors raise like :func:`read_weight` unless dequantization is opted in.
    """
    opted = dequantize_opted_in(owner, dequantize)
    if is_payload_module(module) or is_hf_quantized(module):
        codes = stored_codes(module) if is_payload_module(module) else module.down_proj
        if not opted:
            require_readable_weight(codes, operation=operation, owner=method_owner(module, owner))
        values = _dequantize_module(module)
        if not isinstance(values, dict):
            raise TypeError(f"{type(module).__name__} did not dequantize to gate_up/down weights")
        gate_up = values.get("gate_up", values.get("gate_up_proj"))
        down = values.get("down", values.get("down_proj"))
        if gate_up is None or down is None:
            raise TypeError(
                f"{type(module).__name__} dequantized to {sorted(values)}, not gate_up and down"
            )
        gate = getattr(module, "gate", None)
        stacked = getattr(gate, "layout", "stacked") == "stacked"
        return ExpertWeights(
            gate_up=gate_up,
            down=down,
            layout="halves" if stacked else "interleaved",
            gate_up_bias=_bias(module, "gate_up_bias", "gate_up_proj_bias", operation, owner),
            down_bias=_bias(module, "down_bias", "down_proj_bias", operation, owner),
        )
    gate_up = read_tensor(
        getattr(module, "gate_up_proj", None), operation=operation, owner=owner, dequantize=opted
    )
    down = read_tensor(
        getattr(module, "down_proj", None), operation=operation, owner=owner, dequantize=opted
    )
    if getattr(module, "is_transposed", stored_in_out):
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    concatenated = getattr(module, "is_concatenated", None)
    if concatenated is not None:
        layout = "halves" if concatenated else "interleaved"
    return ExpertWeights(
        gate_up=gate_up,
        down=down,
        layout=layout,
        gate_up_bias=_bias(module, "gate_up_proj_bias", "gate_up_proj_bias", operation, owner),
        down_bias=_bias(module, "down_proj_bias", "down_proj_bias", operation, owner),
    )


def _bias(module: nn.Module, name: str, alt: str, operation: str, owner: Any) -> Tensor | None:
    value = getattr(module, name, None)
    if value is None:
        value = getattr(module, alt, None)
    if value is None:
        return None
    return read_tensor(value, operation=operation, owner=owner)
