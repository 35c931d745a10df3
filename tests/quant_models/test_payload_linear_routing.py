"""Where ``payload_linear`` sends a quantized matmul on an accelerator: the fused kernels, the
Triton dequantize kernel then cuBLAS, or the torch reference, each said once in the log."""

from __future__ import annotations

import logging

import pytest
import torch

import qlens.kernels
from qlens.kernels.dequant import has_dequantize_kernel
from qlens.kernels.runtime import interpreting
from qlens.modules import dispatch
from qlens.quant.adopt.higgs_gguf import gguf_payload
from qlens.quant.codecs.gguf import Q4_1
from qlens.quant.quantize import quantize_weight


def _q4_1(n: int = 8, k: int = 64) -> qlens.QuantPayload:
    blocks = torch.randint(0, 256, (n, k // 32 * Q4_1.type_size), dtype=torch.uint8)
    halfs = (torch.randn(n * k // 32, 2) * 0.01).to(torch.float16)
    blocks.view(-1, Q4_1.type_size)[:, :4] = halfs.view(torch.uint8)
    return gguf_payload(blocks, Q4_1.type_id)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kernel entry points called, each replaced by a recorder; the meta device counts as a
    kernel device."""
    calls: list[str] = []
    monkeypatch.setattr(dispatch, "_WARNED", set())
    monkeypatch.setattr("qlens.kernels.runtime.kernel_device_problem", lambda device: None)
    monkeypatch.setattr(
        qlens.kernels, "supports", lambda payload, device: payload.format.name == "int4"
    )

    def recorder(name: str):
        def call(x, payload, bias=None):
            calls.append(name)
            return torch.empty(*x.shape[:-1], payload.shape[0], device=x.device)

        return call

    for name in ("quantized_linear", "dequantized_linear", "reference_linear"):
        monkeypatch.setattr(qlens.kernels, name, recorder(name))
    return calls


ACTIVATIONS = torch.empty(2, 64, device="meta")


def test_dequantize_kernel_coverage():
    assert has_dequantize_kernel(_q4_1())
    assert has_dequantize_kernel(quantize_weight(torch.randn(8, 64), "int4", group_size=32))


def test_fused_kernels_first_then_dequantize_kernel(calls, caplog):
    with caplog.at_level(logging.WARNING):
        dispatch.payload_linear(ACTIVATIONS, quantize_weight(torch.randn(8, 64), "int4"))
        dispatch.payload_linear(ACTIVATIONS, _q4_1())
    assert calls == ["quantized_linear", "dequantized_linear"]
    assert not caplog.records  # neither is the slow reference


def test_refused_layout_falls_back_to_the_reference_and_says_why(calls, monkeypatch, caplog):
    def refuse(x, payload, bias=None):
        raise ValueError("this GGUF payload permutes its input columns")

    monkeypatch.setattr(qlens.kernels, "dequantized_linear", refuse)
    with caplog.at_level(logging.WARNING):
        dispatch.payload_linear(ACTIVATIONS, _q4_1())
        dispatch.payload_linear(ACTIVATIONS, _q4_1())
    assert calls == ["reference_linear", "reference_linear"]
    assert len(caplog.records) == 1  # once per format and reason
    assert "permutes its input columns" in caplog.records[0].getMessage()
    assert "gguf_q4_1" in caplog.records[0].getMessage()


@pytest.mark.skipif(
    not interpreting(), reason="runs the kernel on CPU tensors (TRITON_INTERPRET=1)"
)
def test_dequantized_linear_checks_values_once_per_payload(monkeypatch):
    """In Triton's interpreter: exact against the reference, and the value checks (a device sync
    each) run on the first call and again only after the payload's tensors change."""
    import qlens.kernels.dequant as dequant_module
    from qlens.kernels.dispatch import dequantized_linear
    from qlens.kernels.reference import reference_linear

    seen: list[bool] = []
    kernel = dequant_module._FORMAT_KERNELS["gguf_q4_1"]

    def spy(payload, dtype, *, launch=None, check_values=True):
        seen.append(check_values)
        return kernel(payload, dtype, launch=launch, check_values=check_values)

    monkeypatch.setitem(dequant_module._FORMAT_KERNELS, "gguf_q4_1", spy)
    payload = _q4_1(16, 64)
    x = torch.randn(3, 64)
    expected = reference_linear(x.double(), payload)
    for _ in range(3):
        got = dequantized_linear(x, payload)
        assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-6
    payload.data = payload.data.clone()
    dequantized_linear(x, payload)
    assert seen == [True, False, False, True]
