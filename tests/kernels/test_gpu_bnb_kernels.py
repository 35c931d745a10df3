"""bitsandbytes NF4/FP4 and LLM.int8 weights through qlens' fused kernels on a real GPU: payloads
and modules made by bitsandbytes itself, against the float32 product of their exact weights and against
bitsandbytes' own forward (skipped without CUDA or bitsandbytes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import rel_err

from qlens.kernels.plan import LinearPlan
from qlens.kernels.runtime import interpreting
from qlens.quant.dequantize import dequantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]
bnb = pytest.importorskip("bitsandbytes")
from qlens.quant.adopt.bnb import payload_from_bnb_4bit  # noqa: E402
from qlens.quant.codecs.bnb import BNB_INT8  # noqa: E402
from qlens.quant.payload import QuantPayload  # noqa: E402

# bf16 outputs round at 2**-9 relative; float32 sums over K run on top.
BF16_TOLERANCE = 8e-3


def _payload(quant_type: str, nested: bool, n: int, k: int):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, state = bnb.functional.quantize_4bit(
        weight, blocksize=64, quant_type=quant_type, compress_statistics=nested
    )
    return payload_from_bnb_4bit(packed, state), packed, state


@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", False), ("nf4", True), ("fp4", False)])
def test_every_row_count_matches_the_exact_weights_on_gpu(quant_type, nested):
    payload, packed, state = _payload(quant_type, nested, 1536, 4096)
    plan = LinearPlan(payload, torch.device("cuda"))
    assert plan.route == "kernel"
    weight = dequantize(payload, torch.float32)
    for rows in (1, 2, 8, 32, 48, 300):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        ours = plan(x)
        exact = F.linear(x.float(), weight)
        assert rel_err(ours, exact) < BF16_TOLERANCE, rows
        own = bnb.matmul_4bit(x, packed.t(), quant_state=state)
        assert rel_err(own, exact) < BF16_TOLERANCE, rows  # the library agrees with the oracle


def _rerouted_eagerly_and_in_a_graph(module: torch.nn.Module, x: torch.Tensor):
    """``module`` rerouted through qlens (``force=True``), then its outputs eagerly on one row
    and on every row of ``x``, captured in a CUDA graph on ``x``'s shape (replayed on new
    rows), and eagerly on those new rows."""
    import qlens

    assert qlens.reroute_quantized_modules(torch.nn.ModuleList([module]), force=True) == ["0"]
    eager = [module(x[:rows]) for rows in (1, x.shape[0])]
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module(static)  # prepares the launch outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = module(static)
    static.copy_(torch.randn_like(x))
    graph.replay()
    return eager, captured, module(static)


def test_rerouted_linear4bit_in_cuda_graphs_and_eagerly_on_gpu():
    torch.manual_seed(0)
    module = bnb.nn.Linear4bit(4096, 1024, bias=True, compute_dtype=torch.bfloat16,
                               quant_type="nf4", device="meta")  # fmt: skip
    module.weight = bnb.nn.Params4bit(
        torch.randn(1024, 4096) * 0.02, requires_grad=False, quant_type="nf4", module=module
    ).to("cuda")
    module.bias = torch.nn.Parameter(torch.randn(1024, device="cuda"), requires_grad=False)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        own = module(x)
        eager, captured, again = _rerouted_eagerly_and_in_a_graph(module, x)
    assert rel_err(eager[1], own) < BF16_TOLERANCE and rel_err(eager[0], own[:1]) < BF16_TOLERANCE
    assert torch.equal(captured, again)  # the graph's launch and the eager one: the same sums


def test_int8_every_row_count_matches_the_exact_weights_on_gpu():
    torch.manual_seed(3)
    weight = torch.randn(1536, 4000, device="cuda", dtype=torch.float16) * 0.02
    q, scb, _ = bnb.functional.int8_vectorwise_quant(weight)  # fp16, as Int8Params quantizes
    payload = QuantPayload(
        BNB_INT8, q, (1536, 4000), scales=scb, layout={"packing": "bitsandbytes"}
    )
    plan = LinearPlan(payload, torch.device("cuda"))
    assert plan.route == "kernel"
    exact_weight = dequantize(payload, torch.float32)
    for rows in (1, 2, 8, 32, 48, 300):
        x = torch.randn(rows, 4000, device="cuda", dtype=torch.bfloat16)
        assert rel_err(plan(x), F.linear(x.float(), exact_weight)) < BF16_TOLERANCE, rows


def test_rerouted_linear8bitlt_eagerly_and_in_cuda_graphs_on_gpu():
    from qlens.quant.adopt import adopt_module

    torch.manual_seed(0)
    module = bnb.nn.Linear8bitLt(4096, 1024, bias=True, has_fp16_weights=False, device="meta")
    module.weight = bnb.nn.Int8Params(
        torch.randn(1024, 4096) * 0.02, requires_grad=False, has_fp16_weights=False
    ).to("cuda")
    module.bias = torch.nn.Parameter(torch.randn(1024, device="cuda"), requires_grad=False)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        own = module(x)  # LLM.int8: int8 activations, outlier columns in fp16
        payload = adopt_module(module)
        exact = F.linear(x.float(), dequantize(payload, torch.float32), module.bias.float())
        eager, captured, again = _rerouted_eagerly_and_in_a_graph(module, x)
    # qlens multiplies the exact weights; bitsandbytes rounds the activations to int8 too
    assert (
        rel_err(eager[1], exact) < BF16_TOLERANCE and rel_err(eager[0], exact[:1]) < BF16_TOLERANCE
    )
    assert rel_err(own, exact) < 5e-2
    assert torch.equal(captured, again)
