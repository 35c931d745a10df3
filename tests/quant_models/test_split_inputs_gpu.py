"""On a CUDA device: TransformerLens' per-head attention inputs run quantized q/k/v projections,
separate (Llama) and fused (GPT-2's ``c_attn``), through qlens' Triton kernels and agree with
the CPU reference (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_route import count_kernel_route
from tiny_models import input_ids, make_model

from qlens.bridge import Bridge
from qlens.modules.model_quantize import SCHEMES, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def head_one_from_previous_position(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
    x = x.clone()
    x[:, :, 1] = x.roll(1, dims=1)[:, :, 1]
    return x


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize(
    ("switch", "edited"),
    [
        ("set_use_split_qkv_input", "blocks.0.attn.hook_k_input"),
        ("set_use_attn_in", "blocks.0.hook_attn_in"),
    ],
)
def test_split_inputs_run_the_kernels_and_match_the_cpu_reference(
    family: str, scheme: str, switch: str, edited: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge = Bridge(quantize(make_model(family), scheme))
    projections = bridge._layers[0].modules
    attention_inputs = ("qkv",) if family == "gpt2" else ("q", "k", "v")
    assert {type(projections[m]).__name__ for m in attention_inputs} == {"QuantLinear"}
    getattr(bridge, switch)(True)
    ids = input_ids()
    hooks = [(edited, head_one_from_previous_position)]
    with torch.no_grad():
        plain = bridge(ids)
        expected = bridge.run_with_hooks(ids, fwd_hooks=hooks)  # CPU: torch reference
    assert (expected - plain).abs().max().item() > 1e-3  # the edit reaches the logits
    calls = count_kernel_route(monkeypatch)
    bridge.to("cuda")
    with torch.no_grad():
        got = bridge.run_with_hooks(ids.cuda(), fwd_hooks=hooks).cpu()
    assert calls, "the CUDA forward did not use qlens' kernels"
    # Same weights, fp32 accumulation: only the kernels' summation order differs, as in
    # test_qmodel_gpu.py's plain forwards.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
