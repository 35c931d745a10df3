"""On a CUDA device: a quantized Qwen3-MoE prefill (and a one-byte experts' decode step) runs
its routed experts as grouped launches, eager and compiled, and agrees with the CPU
reference."""

from __future__ import annotations

import pytest
import torch
from grouped_launches import grouped_launch_grids
from tiny_models import input_ids, make_model

from qlens.kernels.runtime import interpreting
from qlens.modules.model_quantize import quantize

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(),
    reason="needs a CUDA GPU with TRITON_INTERPRET=0",
)


@pytest.mark.parametrize(
    ("scheme", "seq"),
    [(s, 40) for s in ("int4", "mxfp4", "nvfp4", "fp8-block", "mxfp8", "int8")]
    + [("fp8-block", 1), ("int8", 1)],
)
def test_moe_prefill_takes_grouped_launches_and_matches_the_cpu_reference(
    scheme: str, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """seq 40: 80 tokens x top-2, 160 rows, more than 64 (prefill); seq 1: a decode step's 4
    rows, which one-byte experts run in the grouped launch too."""
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
