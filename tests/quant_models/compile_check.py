"""Compile checks run in a fresh interpreter, without the runtime type checks tests/conftest.py
installs (beartype cannot check the fake tensors torch.compile traces fused experts with).

``python compile_check.py model FAMILY SCHEME`` | ``experts`` | ``rerouted_gpt_oss``: exits 0
after every assertion held.
"""

from __future__ import annotations

import sys

import torch
from tiny_models import input_ids, make_model

from qlens.modules import QuantExperts
from qlens.modules.model_quantize import quantize

BACKENDS = ("eager", "aot_eager")


def check_model(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Whole-graph compiles give the eager logits exactly (the ops run the same torch
    reference; a token's two routes are summed in another order, and a + b == b + a)."""
    with torch.no_grad():
        eager = model(ids).logits
        for backend in BACKENDS:
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend, fullgraph=True)
            assert torch.equal(compiled(ids).logits, eager), backend
            assert torch.equal(compiled(ids[:, :3]).logits, model(ids[:, :3]).logits), backend


def check_experts() -> None:
    """QuantExperts trace to two ``qlens::experts_linear`` ops and no graph break."""
    experts = quantize(make_model("qwen3_moe"), "nvfp4").get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, QuantExperts)
    x = torch.randn(5, 128)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 9]])  # 9: a skipped route
    weights = torch.rand(5, 2)
    explanation = torch._dynamo.explain(experts)(x, index, weights)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    called = [
        str(n.target)
        for g in explanation.graphs
        for n in g.graph.nodes
        if n.op == "call_function" and "qlens" in str(n.target)
    ]
    assert called == ["qlens.experts_linear"] * 2, called
    with torch.no_grad():
        eager = experts(x, index, weights)
        torch._dynamo.reset()
        compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
        # The traced form runs the skipped route's row through expert 0 with weight 0, so that
        # expert's float32 matmul has one more row (other blocking): K = 128 products summed in
        # another order, relative error below 128 * 2**-24.
        torch.testing.assert_close(compiled(x, index, weights), eager, rtol=1e-5, atol=1e-5)


def check_rerouted_gpt_oss() -> None:
    from test_qmodel_reroute import _mxfp4_gpt_oss

    from qlens.modules.reroute import reroute_quantized_modules

    model, _ = _mxfp4_gpt_oss()
    reroute_quantized_modules(model)
    check_model(model, input_ids()[:, :4])


if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    if kind == "model":
        family, scheme = args
        check_model(quantize(make_model(family), scheme), input_ids())
    elif kind == "experts":
        check_experts()
    elif kind == "rerouted_gpt_oss":
        check_rerouted_gpt_oss()
    else:
        raise SystemExit(f"unknown check {kind!r}")
    print("compile check passed")
