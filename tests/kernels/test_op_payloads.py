"""The launch plans the linear ops keep for offered payloads (``plan_for_op``): kept with the
offer, dropped when the payload is offered again, never kept for tensors no payload offered."""

from __future__ import annotations

import gc
import weakref

import torch

from qlens.kernels import plan
from qlens.kernels.op_payloads import offer_to_ops, plan_for_op
from qlens.modules import QuantLinear
from qlens.modules.payload_buffers import traced_payload
from qlens.quant.payload_spec import PayloadSpec
from qlens.quant.quantize import quantize_weight

CPU = torch.device("cpu")


def test_the_op_keeps_the_plan_of_the_modules_offered_payload() -> None:
    layer = QuantLinear(quantize_weight(torch.randn(40, 64), "fp8-block"))
    tensors, key = traced_payload(layer._buffers, layer._traced_weight)
    x = torch.randn(2, 64)
    kept = plan_for_op(key, tensors, CPU)
    assert kept is plan_for_op(key, tensors, CPU)
    assert kept is layer.linear_plan("weight", x)  # the eager forward's plan
    w8a8 = plan_for_op(key, tensors, CPU, w8a8=True)
    assert w8a8.w8a8 and w8a8 is not kept and w8a8 is plan_for_op(key, tensors, CPU, w8a8=True)


def test_offering_again_drops_the_kept_plans(monkeypatch) -> None:
    layer = QuantLinear(quantize_weight(torch.randn(40, 64), "int4"))
    tensors, key = traced_payload(layer._buffers, layer._traced_weight)
    before = plan_for_op(key, tensors, CPU)
    layer.load_state_dict(layer.state_dict())  # the same buffers, offered again
    assert traced_payload(layer._buffers, layer._traced_weight)[0] == tensors
    after = plan_for_op(key, tensors, CPU)
    assert after is not before and after.payload is layer.payload_for("weight")
    assert after is plan_for_op(key, tensors, CPU)
    rebuilt = PayloadSpec.of(after.payload).build(tensors)  # any payload offered anew
    offer_to_ops(rebuilt, tensors, key)
    assert plan_for_op(key, tensors, CPU).payload is rebuilt
    asked = []
    monkeypatch.setattr(plan, "plan_for", lambda p, device, w8a8: asked.append(p) or after)
    offer_to_ops(rebuilt, tensors, key)  # the same payload again: its plan is asked again
    assert plan_for_op(key, tensors, CPU) is after and asked == [rebuilt]
    assert plan_for_op(key, tensors, CPU) is after and asked == [rebuilt]


def test_no_plan_is_kept_for_tensors_no_payload_was_offered_with() -> None:
    payload = quantize_weight(torch.randn(40, 64), "int4")
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    built = plan_for_op(key, tensors, CPU)
    assert built.payload is not payload and built.payload.data is tensors[0]
    assert plan_for_op(key, tensors, CPU) is not built
    gone = weakref.ref(built)
    del built
    gc.collect()
    assert gone() is None


def test_a_kept_plan_lasts_only_as_long_as_its_payload() -> None:
    layer = QuantLinear(quantize_weight(torch.randn(40, 64), "int4"))
    tensors, key = traced_payload(layer._buffers, layer._traced_weight)
    kept = weakref.ref(plan_for_op(key, tensors, CPU))
    layer.forget_prepared()  # the module drops its payload (rebuilt on its next forward)
    gc.collect()
    assert kept() is None
    assert plan_for_op(key, tensors, CPU).payload.data is tensors[0]
