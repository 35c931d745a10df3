"""A compiled decode step's routed experts as one ``qlens::moe_decode`` node (the fused MoE
decode's two launches), and the experts that keep one ``qlens::experts_linear`` per projection.
The node is traced on GPUs only; here the CPU is let in (``FUSED_DECODE_DEVICES``), where the
op runs the eager experts forward, so compiled and eager outputs agree exactly."""

from __future__ import annotations

import pytest
import torch
from kernel_route import count_fused_moe_decodes
from tiny_models import input_ids, make_model

import qlens.modules.traced_experts as traced_experts
from qlens.kernels.runtime import interpreting
from qlens.modules import QuantExperts
from qlens.modules.expert_gate import ExpertGate
from qlens.modules.model_quantize import quantize
from qlens.modules.reroute import reroute_quantized_modules
from qlens.quant.payload_spec import PayloadSpec
from qlens.quant.quantize import quantize_weight

HIDDEN, INNER, EXPERTS = 128, 128, 4
# Qwen3-MoE's and Mixtral's gate, GPT-OSS' gate: the two the fused decode computes.
GATES = [ExpertGate("stacked", "silu"), ExpertGate("interleaved", "clamped_swiglu", 1.702, 7.0)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cpu_traces_the_node(monkeypatch):
    monkeypatch.setattr(traced_experts, "FUSED_DECODE_DEVICES", frozenset({"cpu", "cuda"}))


def _qlens_calls(fn, *args) -> list[str]:
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    return [
        str(n.target)
        for g in explanation.graphs
        for n in g.graph.nodes
        if n.op == "call_function" and "qlens" in str(n.target)
    ]


def _experts(scheme: str = "nvfp4", gate: ExpertGate | None = None, **options) -> QuantExperts:
    gen = torch.Generator().manual_seed(0)
    gate_up = quantize_weight(torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=gen), scheme)
    down = quantize_weight(torch.randn(EXPERTS, HIDDEN, INNER, generator=gen), scheme)
    return QuantExperts(gate_up, down, gate or ExpertGate("stacked", "silu"), **options)


def _routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    index = torch.randint(0, EXPERTS, (tokens, 2), generator=gen)
    index[0, 1] = EXPERTS  # a skipped route
    return x, index, torch.rand(tokens, 2, generator=gen)


def _compiled_matches_eager(experts: torch.nn.Module, *args: torch.Tensor) -> None:
    with torch.no_grad():
        eager = experts(*args)
        compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(*args), eager)


@pytest.mark.usefixtures("cpu_traces_the_node")
@pytest.mark.parametrize("gate", GATES, ids=["silu", "clamped_swiglu"])
def test_a_decode_steps_experts_trace_to_one_moe_decode_node(gate: ExpertGate) -> None:
    experts = _experts(gate=gate)
    args = _routing(3)  # 6 routed rows
    with torch.no_grad():
        assert _qlens_calls(experts, *args) == ["qlens.moe_decode"]
    torch._dynamo.reset()
    _compiled_matches_eager(experts, *args)


def _rerouted(checkpoint: str) -> torch.nn.Module:
    """A tiny model with transformers' quantized experts ("gpt_oss mxfp4": Mxfp4GptOssExperts,
    "mixtral fp8": FP8Experts), rerouted through qlens."""
    from test_qmodel_reroute import _fp8_mixtral, _mxfp4_gpt_oss

    model, _ = _mxfp4_gpt_oss() if checkpoint == "gpt_oss mxfp4" else _fp8_mixtral()
    reroute_quantized_modules(model)
    return model


def _w8a8_experts() -> QuantExperts:
    return _experts("fp8-block", w8a8=True)


@pytest.mark.usefixtures("cpu_traces_the_node")
@pytest.mark.parametrize(
    ("case", "build", "tokens", "grad"),
    [
        ("more rows than a decode", _experts, 40, False),  # 80 routed rows
        ("a gradient to carry", _experts, 3, True),
        ("FP8 activations (W8A8)", _w8a8_experts, 3, False),
        (
            "a gate with no fused form",
            lambda: _experts(gate=ExpertGate("stacked", "gelu")),
            3,
            False,
        ),
    ],
)
def test_other_experts_keep_one_experts_op_per_projection(case, build, tokens, grad) -> None:
    experts = build()
    x, index, weights = _routing(tokens)
    with torch.set_grad_enabled(grad):
        calls = _qlens_calls(experts, x.requires_grad_(grad), index, weights)
    assert calls == ["qlens.experts_linear"] * 2, case


def test_gpus_only_trace_the_node_by_default() -> None:
    with torch.no_grad():
        assert _qlens_calls(_experts(), *_routing(3)) == ["qlens.experts_linear"] * 2


@pytest.mark.usefixtures("cpu_traces_the_node")
@pytest.mark.parametrize("checkpoint", ["gpt_oss mxfp4", "mixtral fp8"])
def test_rerouted_experts_trace_to_the_node_and_give_the_eager_logits(checkpoint: str) -> None:
    """GPT-OSS' clamped SwiGLU and FP8Experts' own gate (checked to be ``silu(gate) * up``)."""
    model = _rerouted(checkpoint)
    ids = input_ids()[:, :3]  # 6 tokens, 2 routes each
    with torch.no_grad():
        eager = model(ids).logits
        assert "qlens.moe_decode" in _qlens_calls(model, ids)
        torch._dynamo.reset()
        assert torch.equal(
            torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits, eager
        )


@pytest.mark.usefixtures("cpu_traces_the_node")
def test_a_compiled_moe_model_gives_the_eager_logits_at_decode_and_prefill() -> None:
    model = quantize(make_model("qwen3_moe"), "int4")
    with torch.no_grad():
        for ids in (input_ids(seq=1), input_ids(seq=40)):  # 4 and 160 routed rows
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
            assert torch.equal(compiled(ids).logits, model(ids).logits)


@pytest.mark.skipif(not interpreting(), reason="runs the kernels on CPU tensors")
@pytest.mark.usefixtures("cpu_traces_the_node")
def test_the_node_runs_the_fused_decode_where_the_plans_are_accelerated(monkeypatch) -> None:
    """In the interpreter, plans taken as an accelerator's: the compiled step launches the
    fused decode and gives the eager step's output exactly (the same kernels, same inputs)."""
    calls = count_fused_moe_decodes(monkeypatch, accelerate=True)
    experts = _experts("int4")
    x, index, weights = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _routing(2))
    with torch.no_grad():
        eager = experts(x, index, weights)
        compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)(x, index, weights)
    assert calls == [1, 1]  # the eager step, then the compiled one
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("bias", [False, True])
def test_the_moe_decode_op_passes_opcheck(bias: bool) -> None:
    experts = _experts("mxfp4")
    first, down = experts.gate_up_payload, experts.down_payload
    gen = torch.Generator().manual_seed(2)
    biases = (
        (
            torch.randn(EXPERTS, 2 * INNER, generator=gen),
            torch.randn(EXPERTS, HIDDEN, generator=gen),
        )
        if bias
        else (None, None)
    )
    args = (
        *_routing(3),
        list(first.tensors().values()), PayloadSpec.of(first).key,
        list(down.tensors().values()), PayloadSpec.of(down).key,
        *biases, False, "silu", 0.0, 0.0,
    )  # fmt: skip
    torch.library.opcheck(traced_experts.moe_decode_op, args)


@pytest.mark.parametrize("gate", GATES, ids=["silu", "clamped_swiglu"])
def test_the_op_rebuilds_the_modules_gate_from_its_fused_rule(gate: ExpertGate) -> None:
    rule = gate.kernel_rule
    assert rule is not None
    rebuilt = traced_experts._gate_of(rule.interleaved, rule.activation, rule.alpha, rule.limit)
    assert rebuilt == gate and rebuilt.kernel_rule == rule


@pytest.mark.usefixtures("cpu_traces_the_node")
def test_bridge_hooks_around_the_routed_experts_fire_in_the_compiled_decode() -> None:
    """Qwen2-MoE (routed experts plus a shared expert): the hook on the routed term, outside the
    node, sees and edits in the compiled graph what it sees and edits eagerly."""
    from qlens.bridge import Bridge

    bridge = quantize(Bridge(make_model("qwen2_moe")), "int4")
    ids = input_ids(seq=1)  # a decode step's shape: 2 tokens x 2 routes
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}
    run = ["eager"]

    def halve_routed(x: torch.Tensor, hook) -> torch.Tensor:
        seen[run[0]].append(x.detach().clone())
        return x / 2

    bridge.add_hook("blocks.0.mlp.hook_routed_out", halve_routed)
    with torch.no_grad():
        eager = bridge(ids)
        assert "qlens.moe_decode" in _qlens_calls(bridge.model, ids)
        torch._dynamo.reset()
        run[0] = "compiled"
        bridge.model.compile(backend="aot_eager")
        compiled = bridge(ids)
    assert len(seen["compiled"]) == 1 and torch.equal(seen["compiled"][0], seen["eager"][0])
    assert torch.equal(compiled, eager)
    bridge.reset_hooks()
    with torch.no_grad():
        assert not torch.equal(bridge(ids), eager)  # the edit was real


@pytest.mark.parametrize("node", [False, True], ids=["ops", "node"])
@pytest.mark.parametrize("checkpoint", ["gpt_oss mxfp4", "mixtral fp8"])
def test_rerouted_experts_compile_before_any_eager_call(
    checkpoint: str, node: bool, request
) -> None:
    """The module's gate (FP8Experts' own, checked on a probe to be ``silu(gate) * up``) is
    read when it is rerouted, so a whole-graph compile can come first."""
    if node:
        request.getfixturevalue("cpu_traces_the_node")
    model = _rerouted(checkpoint)
    ids = input_ids()[:, :3]
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
        assert torch.equal(compiled, model(ids).logits)


@pytest.mark.usefixtures("cpu_traces_the_node")
def test_compiled_decode_steps_build_no_payload_or_plan(monkeypatch) -> None:
    """Outside CUDA graphs the node's body runs on every call: it reaches the module's kept
    payloads and plans by their tensors, also when no eager call ran first."""
    from test_compile import _Builds

    model = quantize(make_model("qwen3_moe"), "mxfp4")
    builds = _Builds(monkeypatch)
    ids = input_ids(seq=1)
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        first = compiled(ids).logits
        assert "qlens.moe_decode" in _qlens_calls(model, ids)
        after_first = builds.count
        for _ in range(3):
            assert torch.equal(compiled(ids).logits, first)
    assert builds.count == after_first
    assert torch.equal(first, model(ids).logits)
