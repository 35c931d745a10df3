"""The grouped experts GEMM compiled for a real GPU at a Qwen3-30B-A3B-like prefill and decode
(skipped without CUDA): 64 experts, hidden 2048, moe_intermediate 768, 1024 tokens (prefill)
or 1-4 tokens (decode) routed top-8."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_cases import count_grouped_launches, rel_err, scheme_id

from qlens.kernels import experts_linear
from qlens.kernels.runtime import interpreting
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]
EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, TOP_K = 64, 2048, 768, 1024, 8
SCHEMES = (
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 32, "asymmetric": True}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("fp8-block", {}),
    ("mxfp8", {}),
    ("int8", {"group_size": 128}),
)
BYTE_SCHEMES = SCHEMES[4:]
# bf16 activations and decoded weights round at 2**-9 relative, as do the outputs.
BF16_TOLERANCE = 8e-3


def _routes(gen: torch.Generator, tokens: int = TOKENS) -> torch.Tensor:
    """Top-8 experts of ``tokens`` tokens under random router logits, one id per (token, route)
    row."""
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    return logits.topk(TOP_K, dim=-1).indices.reshape(-1).cuda()


def _payload(n: int, k: int, case, gen: torch.Generator):
    name, kwargs = case
    weight = torch.randn(EXPERTS, n, k, generator=gen) * 0.02
    return quantize_weight(weight.cuda(), name, **kwargs)  # quantized on the GPU: faster


def _reference(x: torch.Tensor, payload, ids: torch.Tensor) -> torch.Tensor:
    """float64 products of each expert's dequantized weight with its rows."""
    weights = dequantize(payload, torch.float32)
    out = torch.empty((x.shape[0], weights.shape[1]), dtype=torch.float64, device=x.device)
    for expert in range(EXPERTS):
        rows = torch.nonzero(ids == expert).squeeze(1)
        out[rows] = x[rows].double() @ weights[expert].double().T
    return out


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_grouped_experts_at_prefill_shapes_on_gpu(case, monkeypatch):
    """Both projections of every (token, route) row in one launch each, against float64
    (NVFP4's gate_up with one global scale per expert, its down with one for all)."""
    launches = count_grouped_launches(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    ids = _routes(gen)
    for n, k in ((2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
        payload = _payload(n, k, case, gen)
        if case[0] == "nvfp4" and n > k:  # gate_up: one global scale per expert (modelopt)
            scaled = payload.global_scale * torch.linspace(0.5, 2, EXPERTS, device="cuda")
            payload = replace(payload, global_scale=scaled)
        bias = (torch.randn(EXPERTS, n, generator=gen) * 0.1).cuda().to(torch.bfloat16)
        x = torch.randn(TOKENS * TOP_K, k, generator=gen).cuda().to(torch.bfloat16)
        out = experts_linear(x, payload, ids, bias, ids_in_range=True)
        ref = _reference(x, payload, ids) + bias.double()[ids]
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert rel_err(out, ref) < BF16_TOLERANCE, (n, k)
        del payload
        torch.cuda.empty_cache()
    assert len(launches) == 2


@pytest.mark.parametrize("case", BYTE_SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("tokens", [1, 4])
def test_byte_experts_decode_rows_in_one_launch_on_gpu(case, tokens, monkeypatch):
    """A decode step's few rows of one-byte experts take one grouped launch a projection."""
    launches = count_grouped_launches(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    ids = _routes(gen, tokens)
    for n, k in ((2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
        payload = _payload(n, k, case, gen)
        bias = (torch.randn(EXPERTS, n, generator=gen) * 0.1).cuda().to(torch.bfloat16)
        x = torch.randn(tokens * TOP_K, k, generator=gen).cuda().to(torch.bfloat16)
        out = experts_linear(x, payload, ids, bias, ids_in_range=True)
        ref = _reference(x, payload, ids) + bias.double()[ids]
        assert rel_err(out, ref) < BF16_TOLERANCE, (n, k)
    assert len(launches) == 2


@pytest.mark.parametrize(
    ("scheme", "tokens"), [("nvfp4", TOKENS), ("fp8-block", TOKENS), ("fp8-block", 2)]
)
def test_grouped_experts_make_no_host_sync_on_gpu(scheme, tokens):
    """With CUDA's sync debug mode set to error, a warm grouped call raises on any sync."""
    gen = torch.Generator().manual_seed(1)
    ids = _routes(gen, tokens)
    payload = _payload(2 * INTERMEDIATE, HIDDEN, (scheme, {}), gen)
    x = torch.randn(tokens * TOP_K, HIDDEN, generator=gen).cuda().to(torch.bfloat16)
    expected = experts_linear(x, payload, ids, ids_in_range=True)  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = experts_linear(x, payload, ids, ids_in_range=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, expected)  # deterministic: no atomics, fixed summation order


def test_quant_experts_prefill_matches_the_expert_loop_on_gpu(monkeypatch):
    """A QuantExperts prefill (grouped launches) against the same module run expert by
    expert (each expert's own linear), both in bf16."""
    from qlens.kernels.experts import ExpertsPlan
    from qlens.modules import ExpertGate, QuantExperts

    gen = torch.Generator().manual_seed(2)
    case = ("int4", {"group_size": 128})
    experts = QuantExperts(
        _payload(2 * INTERMEDIATE, HIDDEN, case, gen),
        _payload(HIDDEN, INTERMEDIATE, case, gen),
        ExpertGate("stacked", "silu"),
    )
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen).cuda().to(torch.bfloat16)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen).cuda()
    weights, index = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    launches = count_grouped_launches(monkeypatch)
    with torch.no_grad():
        grouped = experts(hidden, index, weights.to(torch.bfloat16))
        assert len(launches) == 2
        monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: False)
        loop = experts(hidden, index, weights.to(torch.bfloat16))
    assert len(launches) == 2
    assert rel_err(grouped, loop) < 2 * BF16_TOLERANCE


@pytest.mark.parametrize(("scheme", "tokens"), [("mxfp4", TOKENS), ("fp8-block", 2)])
def test_grouped_experts_replay_in_a_cuda_graph_on_gpu(scheme, tokens):
    """No host sync, so the grouped call captures into a CUDA graph; a replay on new routes and
    activations (copied into the captured inputs) equals an eager call on them."""
    gen = torch.Generator().manual_seed(3)
    payload = _payload(HIDDEN, INTERMEDIATE, (scheme, {}), gen)
    ids = _routes(gen, tokens)
    x = torch.randn(tokens * TOP_K, INTERMEDIATE, generator=gen).cuda().to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts_linear(x, payload, ids, ids_in_range=True)  # compile and allocate first
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts_linear(x, payload, ids, ids_in_range=True)
    ids.copy_(_routes(gen, tokens))
    x.copy_(torch.randn(x.shape, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, experts_linear(x, payload, ids, ids_in_range=True))


def test_the_expert_loop_refuses_a_cuda_graph_capture_on_gpu():
    """W8A8 experts run one launch per used expert (a host read of the routing): captured into
    a CUDA graph they raise the qlens error, before any operation that breaks the capture."""
    gen = torch.Generator().manual_seed(5)
    payload = _payload(HIDDEN, INTERMEDIATE, ("fp8-block", {}), gen)
    ids = _routes(gen, 2)
    x = torch.randn(2 * TOP_K, INTERMEDIATE, generator=gen).cuda().to(torch.bfloat16)
    experts_linear(x, payload, ids, w8a8=True, ids_in_range=True)  # runs eagerly
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"run one launch per used expert \(W8A8\)"):
        with torch.cuda.graph(graph):
            experts_linear(x, payload, ids, w8a8=True, ids_in_range=True)
