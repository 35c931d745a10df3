"""Keep a QuantPayload's tensors as module buffers, so ``.to()``, state_dict and device maps see them."""

from __future__ import annotations

from collections.abc import Callable
from operator import is_
from typing import Any, TypeVar, cast

import torch
from torch import nn

from qlens.kernels.experts import ExpertsPlan, experts_plan_for
from qlens.kernels.op_payloads import offer_to_ops
from qlens.kernels.plan import LinearPlan, plan_for
from qlens.modules.dispatch import check_payload_device
from qlens.quant.payload import QuantPayload
from qlens.quant.payload_spec import PayloadSpec

__all__ = ["PayloadModule", "PayloadSpec", "buffer_name", "traced_payload"]

P = TypeVar("P", LinearPlan, ExpertsPlan)


def _w8a8_plan_for(payload: QuantPayload, device: torch.device) -> LinearPlan:
    return plan_for(payload, device, w8a8=True)


def buffer_name(prefix: str, tensor_name: str) -> str:
    """Buffer holding one payload tensor: ``{prefix}_data``, ``{prefix}_scales``, ``{prefix}_extra_<k>``."""
    return f"{prefix}_{tensor_name.replace('.', '_')}"


def traced_attribute(prefix: str) -> str:
    """The attribute holding what a traced forward passes the ops for the payload ``prefix``."""
    return f"_traced_{prefix}"


def traced_payload(
    buffers: dict[str, Any], traced: tuple[Any, ...]
) -> tuple[list[torch.Tensor], str]:
    """The payload's buffers and spec key, as a forward passes them to the ``qlens::`` ops
    while ``torch.compile`` traces it (``buffers``: the module's ``_buffers``; ``traced``: its
    ``traced_attribute``, ``(spec key, buffer names, *what else the module's trace reads)``).
    A plain function over one plain attribute, so that dynamo guards the tensors and one
    tuple of constants, not the module's methods and bookkeeping dicts (on a 32-layer int4
    model, 15% less guard-check time: ``benchmarks/results/compile_guards_cpu.md``).
    """
    key, names = traced[0], traced[1]
    return [buffers[name] for name in names], key


class PayloadModule(nn.Module):
    """Base of modules whose quantized weights live in payloads registered as buffers.

    Payload buffers follow device moves but keep their dtype: ``model.to(torch.bfloat16)`` or
    ``.half()`` casts biases and other float tensors, never packed data or scales (an fp8 weight
    or an fp32 scale cast to bf16 would silently change the weight).

    The payload built on the buffers is kept (with the launch plans the kernels keep on it) and
    rebuilt only when the buffers change: ``.to()``/``_apply``, ``load_state_dict``, or a buffer
    replaced in place of another (device maps and offloading hooks do that). The linear plan
    of each payload is kept on the module too (``linear_plan``), so a forward reaches it
    with one identity check of the buffers.
    """

    def __init__(self) -> None:
        super().__init__()
        self._payload_specs: dict[str, PayloadSpec] = {}
        self._payload_buffers: dict[str, tuple[str, ...]] = {}
        self._prepared: dict[str, tuple[tuple[torch.Tensor, ...], QuantPayload]] = {}
        self._plans: dict[str, tuple[tuple[torch.Tensor, ...], LinearPlan | ExpertsPlan]] = {}

    def register_payload(self, prefix: str, payload: QuantPayload) -> None:
        """Register every tensor of ``payload`` as a persistent buffer under ``prefix``."""
        spec = PayloadSpec.of(payload)
        self._payload_specs[prefix] = spec
        self._payload_buffers[prefix] = tuple(buffer_name(prefix, n) for n in spec.tensor_names)
        setattr(self, traced_attribute(prefix), (spec.key, self._payload_buffers[prefix]))
        for name, tensor in payload.tensors().items():
            self.register_buffer(buffer_name(prefix, name), tensor)
        self.prepare_payloads()

    def trace_with(self, prefix: str, extra: Any) -> None:
        """Put ``extra`` in what a compiled forward reads for the payload ``prefix``
        (``traced_attribute``, its third item): in the one tuple dynamo already guards by
        value, so it adds no guard, and a change of it recompiles."""
        key, names = getattr(self, traced_attribute(prefix))[:2]
        setattr(self, traced_attribute(prefix), (key, names, extra))

    def payload_tensors(self, prefix: str) -> list[torch.Tensor]:
        """The buffers of the payload under ``prefix``, in ``PayloadSpec.tensor_names`` order."""
        return [self._payload_buffer(name) for name in self._payload_buffers[prefix]]

    def payload_for(self, prefix: str) -> QuantPayload:
        """The payload registered under ``prefix``, on the buffers as they are now."""
        spec = self._payload_specs[prefix]
        buffers = self._buffers
        names = self._payload_buffers[prefix]
        kept = self._prepared.get(prefix)
        if kept is not None and all(buffers[n] is t for n, t in zip(names, kept[0], strict=True)):
            return kept[1]
        tensors = tuple(self.payload_tensors(prefix))
        payload = spec.build(tensors)
        self._prepared[prefix] = (tensors, payload)
        offer_to_ops(payload, tensors, spec.key)
        return payload

    def linear_plan(self, prefix: str, x: torch.Tensor, w8a8: bool = False) -> LinearPlan:
        """The launch plan (``qlens.kernels.plan_for``) of the payload under ``prefix`` for
        inputs ``x``, kept while the buffers are the same tensors; raises when ``x`` is on
        another device than the payload. ``w8a8``: FP8 activations (a module switching it drops
        its kept plan)."""
        return self._kept_plan(prefix, x, _w8a8_plan_for if w8a8 else plan_for)

    def experts_plan(self, prefix: str, x: torch.Tensor) -> ExpertsPlan:
        """``linear_plan`` for an ``[experts, out, in]`` payload (``experts_plan_for``)."""
        return self._kept_plan(prefix, x, experts_plan_for)

    def _kept_plan(
        self, prefix: str, x: torch.Tensor, build: Callable[[QuantPayload, torch.device], P]
    ) -> P:
        kept = self._plans.get(prefix)
        if kept is not None:
            tensors, plan = kept
            now = map(self._buffers.__getitem__, self._payload_buffers[prefix])
            if all(map(is_, now, tensors)) and x.device == plan.device:
                return cast(P, plan)
        payload = self.payload_for(prefix)
        check_payload_device(payload, x, type(self).__name__)
        built = build(payload, x.device)
        self._plans[prefix] = (self._prepared[prefix][0], built)
        return built

    def _payload_buffer(self, name: str) -> torch.Tensor:
        tensor = self._buffers[name]
        if tensor is None:
            raise RuntimeError(f"payload buffer {name} was set to None")
        return tensor

    def payload_specs(self) -> dict[str, PayloadSpec]:
        """The non-tensor description of each registered payload, by prefix."""
        return dict(self._payload_specs)

    def forget_prepared(self) -> None:
        """Drop the kept payloads and their launch plans (rebuilt on the next forward)."""
        self._prepared.clear()
        self._plans.clear()

    def prepare_payloads(self) -> None:
        """Drop the kept payloads and launch plans, then build the payloads again on the
        buffers as they are now, offered to the ``qlens::`` ops (``offer_to_ops``), so a
        compiled forward reaches their kept plans even when no eager forward ran first."""
        self.forget_prepared()
        for prefix in self._payload_specs:
            self.payload_for(prefix)

    def _payload_buffer_names(self) -> list[str]:
        return [name for names in self._payload_buffers.values() for name in names]

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> PayloadModule:
        originals = {name: self._buffers[name] for name in self._payload_buffer_names()}
        super()._apply(fn, recurse)
        for name, original in originals.items():
            moved = self._buffers[name]
            if original is not None and moved is not None and moved.dtype != original.dtype:
                self._buffers[name] = original.to(device=moved.device)
        self.prepare_payloads()
        return self

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.prepare_payloads()
