"""On a CUDA device: a quantized Qwen3-MoE prefill runs its routed experts as grouped launches,
and a decode step as the fused MoE decode, eager and compiled, and agrees with the CPU
reference."""

from __future__ import annotations

import pytest
import torch
from grouped_launches import grouped_launch_grids
from kernel_route import count_fused_moe_decodes
from tiny_models import input_ids, make_model

from qlens.kernels.runtime import interpreting
from qlens.modules.model_quantize import quantize

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(),
    reason="needs a CUDA GPU with TRITON_INTERPRET=0",
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles a new model's forward: without a reset, the tenth would pass dynamo's
    recompile limit for that code, which ``fullgraph=True`` turns into an error."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("scheme", "seq"),
    [(s, 40) for s in ("int4", "mxfp4", "nvfp4", "fp8-block", "mxfp8", "int8")],
)
def test_moe_prefill_takes_grouped_launches_and_matches_the_cpu_reference(
    scheme: str, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """80 tokens x top-2: 160 rows, more than the fused decode's 64."""
    model = quantize(make_model("qwen3_moe"), scheme)
    ids = input_ids(seq=seq, batch=2)
    with torch.no_grad():
        expected = model(ids).logits  # CPU: each expert through the torch reference
    grids = grouped_launch_grids(monkeypatch)
    model.to("cuda")
    with torch.no_grad():
        got = model(ids.cuda()).logits.cpu()
        assert len(grids) == 2  # gate_up and down of the one MoE layer
        compiled = torch.compile(model, fullgraph=True)
        traced = compiled(ids.cuda()).logits.cpu()
    assert len(grids) > 2  # the compiled qlens::experts_linear ops take them too
    # Same weights, fp32 activations and IEEE dots: only summation orders differ.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Inductor also fuses the fp32 norms, rotary and softmax in another order.
    torch.testing.assert_close(traced, got, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "fp8-block", "int8"])
def test_a_moe_decode_step_takes_the_fused_decode_and_matches_the_cpu_reference(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 tokens x top-2: each MoE block's routed experts in the fused decode's two launches,
    eager and in the compiled graph (``qlens::moe_decode``)."""
    model = quantize(make_model("qwen3_moe"), scheme)
    ids = input_ids(seq=1, batch=2)
    with torch.no_grad():
        expected = model(ids).logits
    calls = count_fused_moe_decodes(monkeypatch)
    model.to("cuda")
    with torch.no_grad():
        got = model(ids.cuda()).logits.cpu()
        assert len(calls) == 1  # the one MoE layer
        traced = torch.compile(model, fullgraph=True)(ids.cuda()).logits.cpu()
    assert len(calls) == 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(traced, got, atol=1e-4, rtol=1e-4)
