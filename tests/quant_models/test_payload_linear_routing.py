"""Where ``qlens.kernels.linear`` sends a quantized matmul on an accelerator: the fused kernels,
the Triton dequantize kernel then cuBLAS, or the torch reference, each said once in the log."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch

import qlens
import qlens.kernels.plan as plan
from qlens.kernels.dequant import has_dequantize_kernel
from qlens.kernels.formats import kernel_support
from qlens.kernels.runtime import interpreting
from qlens.quant.adopt.higgs_gguf import gguf_payload
from qlens.quant.codecs.gguf import Q4_1
from qlens.quant.codecs.registry import codec_for
from qlens.quant.quantize import quantize_weight

META = torch.device("meta")


def _q4_1(n: int = 8, k: int = 64) -> qlens.QuantPayload:
    blocks = torch.randint(0, 256, (n, k // 32 * Q4_1.type_size), dtype=torch.uint8)
    halfs = (torch.randn(n * k // 32, 2) * 0.01).to(torch.float16)
    blocks.view(-1, Q4_1.type_size)[:, :4] = halfs.view(torch.uint8)
    return gguf_payload(blocks, Q4_1.type_id)


def _replace_q4_1_kernel(monkeypatch: pytest.MonkeyPatch, kernel: Callable[..., torch.Tensor]):
    """Run ``kernel`` as the Triton dequantize of gguf_q4_1 for this test."""
    support = kernel_support("gguf_q4_1")
    replaced = dataclasses.replace(support, triton_dequantize=kernel)
    monkeypatch.setattr(codec_for("gguf_q4_1"), "kernels", replaced)


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta device counts as a kernel device; the log starts empty."""
    monkeypatch.setattr(plan, "_WARNED", set())
    monkeypatch.setattr(plan, "kernel_device_problem", lambda device: None)


def test_dequantize_kernel_coverage():
    assert has_dequantize_kernel(_q4_1())
    assert has_dequantize_kernel(quantize_weight(torch.randn(8, 64), "int4", group_size=32))


def test_fused_kernels_first_then_dequantize_kernel(accelerator, caplog):
    with caplog.at_level(logging.WARNING):
        fused = plan.plan_for(quantize_weight(torch.randn(8, 64), "int4"), META)
        dequantized = plan.plan_for(_q4_1(), META)
    assert (fused.route, dequantized.route) == ("kernel", "dequantize")
    assert fused.view is not None and dequantized.view is None
    assert not caplog.records  # neither is the slow reference


def test_the_cpu_takes_the_reference_silently(caplog):
    with caplog.at_level(logging.WARNING):
        chosen = plan.plan_for(quantize_weight(torch.randn(8, 64), "int4"), torch.device("cpu"))
    assert chosen.route == "reference" and not caplog.records


def test_plans_are_kept_until_the_payload_changes(accelerator):
    payload = quantize_weight(torch.randn(8, 64), "int4")
    first = plan.plan_for(payload, META)
    assert plan.plan_for(payload, META) is first
    assert plan.plan_for(payload, torch.device("cpu")) is not first  # one plan per device
    payload.scales = payload.scales.clone()
    assert plan.plan_for(payload, META) is not first


def test_refused_layout_falls_back_to_the_reference_and_says_why(accelerator, monkeypatch, caplog):
    def refuse(payload, dtype, *, launch=None, check_values=True):
        raise ValueError("this GGUF payload permutes its input columns")

    _replace_q4_1_kernel(monkeypatch, refuse)
    x = torch.randn(2, 64)
    payload = _q4_1()
    chosen = plan.LinearPlan(payload, META)
    with caplog.at_level(logging.WARNING):
        got = chosen(x)
        again = chosen(x)
        plan.LinearPlan(_q4_1(), META)(x)
    assert chosen.route == "reference"
    expected = qlens.kernels.reference_linear(x, payload)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert len(caplog.records) == 1  # once per format and reason
    assert "permutes its input columns" in caplog.records[0].getMessage()
    assert "gguf_q4_1" in caplog.records[0].getMessage()


@pytest.mark.skipif(
    not interpreting(), reason="runs the kernel on CPU tensors (TRITON_INTERPRET=1)"
)
@pytest.mark.parametrize("entry", ["dequantized_linear", "plan"])
def test_dequantize_route_checks_values_once_per_payload(entry, monkeypatch):
    """In Triton's interpreter: exact against the reference, and the value checks (a device sync
    each) run on the first call and again only after the payload's tensors change."""
    from qlens.kernels.dispatch import dequantized_linear
    from qlens.kernels.reference import reference_linear

    seen: list[bool] = []
    kernel = kernel_support("gguf_q4_1").triton_dequantize

    def spy(payload, dtype, *, launch=None, check_values=True):
        seen.append(check_values)
        return kernel(payload, dtype, launch=launch, check_values=check_values)

    def run(x, payload):
        if entry == "dequantized_linear":
            return dequantized_linear(x, payload)
        return plan.cached_on_payload(
            payload, "dequantize_plan", lambda p: plan.LinearPlan(p, x.device, "dequantize")
        )(x)

    _replace_q4_1_kernel(monkeypatch, spy)
    payload = _q4_1(16, 64)
    x = torch.randn(3, 64)
    expected = reference_linear(x.double(), payload)
    for _ in range(3):
        got = run(x, payload)
        assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-6
    payload.data = payload.data.clone()
    run(x, payload)
    assert seen == [True, False, False, True]


def test_the_linear_op_runs_the_eager_plan(monkeypatch) -> None:
    """``qlens::linear`` (what a compiled graph calls) asks for the plan an eager call asks for
    and gives the eager result, for one row and several."""
    import qlens.kernels.ops  # noqa: F401 - registers torch.ops.qlens
    from qlens.quant.payload_spec import PayloadSpec

    payload = quantize_weight(torch.randn(8, 64), "nvfp4")
    asked: list[tuple[torch.device, bool]] = []
    real = plan.plan_for

    def recording(p, device, *, w8a8=False):
        asked.append((device, w8a8))
        return real(p, device, w8a8=w8a8)

    monkeypatch.setattr(plan, "plan_for", recording)
    spec = PayloadSpec.of(payload)
    tensors = [payload.tensors()[name] for name in spec.tensor_names]
    for rows in (1, 3):
        x = torch.randn(rows, 64)
        eager = plan.linear(x, payload)
        assert torch.equal(torch.ops.qlens.linear(x, tensors, spec.key, None), eager)
    assert asked == [(x.device, False)] * 4
