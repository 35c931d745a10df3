"""``torch.compile`` over quantized models on the CPU: one ``qlens::`` op per quantized linear or
experts projection, no graph break, the eager logits, hooks still firing. The runtime type checks
stay on (tests/typecheck_outside_compile.py skips them only inside traced code)."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import input_ids, make_model

from benchmarks._dynamo_guards import logged_guards
from qlens.bridge import Bridge
from qlens.kernels import ops
from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.reroute import reroute_quantized_modules
from qlens.quant.payload_spec import PayloadSpec
from qlens.quant.quantize import quantize_weight

CASES = [("llama", "int4"), ("llama", "nvfp4"), ("llama", "fp8-block")]
# Fused experts in three formats and three MoE families.
MOE_CASES = [("qwen3_moe", "mxfp4"), ("mixtral", "int8"), ("gpt_oss", "nvfp4")]
BACKENDS = ["eager", "aot_eager"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("family", "scheme"), CASES)
def test_compiled_model_gives_the_eager_logits(family: str, scheme: str, backend: str) -> None:
    """Exactly: the ops run the same torch reference on the same inputs as the eager modules,
    and the rest of the graph runs the same aten ops."""
    model = quantize(make_model(family), scheme)
    ids = input_ids()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        assert torch.equal(compiled(ids).logits, eager)
        # Another length: the graph is recompiled or dynamic, still exact.
        assert torch.equal(compiled(ids[:, :5]).logits, model(ids[:, :5]).logits)


def test_a_quant_linear_traces_to_one_op_with_no_graph_break() -> None:
    layer = QuantLinear(quantize_weight(torch.randn(48, 96), "int4"), torch.randn(48))
    x = torch.randn(3, 96)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    graph = explanation.graphs[0].graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert targets == ["qlens.linear"]


def test_a_compiled_quant_linear_rejects_inputs_of_another_width() -> None:
    layer = QuantLinear(quantize_weight(torch.randn(48, 96), "int4"))
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"expects inputs with 96 features .* shape \[3, 95\]"):
        compiled(torch.randn(3, 95))


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "int4"])
def test_one_token_and_a_prompt_trace_to_the_linear_op(scheme: str) -> None:
    """One token's rows and a prompt's reach the kernels through ``qlens::linear`` alone, with
    no graph break, and the compiled step gives eager's logits exactly."""
    model = quantize(make_model("llama"), scheme)
    token, tokens = input_ids()[:1, :1], input_ids()[:1]

    def traced_ops(ids: torch.Tensor) -> set[str]:
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(ids)
        assert explanation.graph_break_count == 0
        nodes = [n for g in explanation.graphs for n in g.graph.nodes]
        return {str(n.target) for n in nodes if "qlens" in str(n.target)}

    with torch.no_grad():
        assert traced_ops(token) == {"qlens.linear"}
        assert traced_ops(tokens) == {"qlens.linear"}
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(token).logits, model(token).logits)


# What a traced quantized forward must not read: guards on them cost every compiled call.
BOOKKEEPING = ("_payload_keys", "_payload_buffers", "_payload_specs", "payload_tensors",
               "payload_key", "_prepared", "_plans", "in_features", "_w8a8", "_w8a8_groups")  # fmt: skip


@pytest.mark.parametrize(("family", "scheme"), [("llama", "int4"), ("qwen3_moe", "mxfp4")])
def test_compiled_quant_modules_guard_their_tensors_not_their_bookkeeping(
    family: str, scheme: str
) -> None:
    model = quantize(make_model(family), scheme)
    ids = input_ids()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        guards = logged_guards(lambda: compiled(ids))
    assert "_buffers['weight_data']" in guards or "_buffers['gate_up_data']" in guards, guards
    read = [name for name in BOOKKEEPING if re.search(rf"[.'\"]{name}\b", guards)]
    assert read == []


@pytest.mark.parametrize(("family", "scheme"), MOE_CASES)
def test_fused_experts_models_give_the_eager_logits(family: str, scheme: str) -> None:
    """Exactly: the experts op runs the same torch reference; a token's routes are summed in
    another order, and a + b == b + a for two routes."""
    check_compiled_logits(quantize(make_model(family), scheme), input_ids())


def test_fused_experts_trace_to_two_ops_with_no_graph_break() -> None:
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


def test_rerouted_gpt_oss_experts_give_the_eager_logits() -> None:
    from test_qmodel_reroute import _mxfp4_gpt_oss

    model, _ = _mxfp4_gpt_oss()
    reroute_quantized_modules(model)
    check_compiled_logits(model, input_ids()[:, :4])


def check_compiled_logits(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Whole-graph compiles under each backend give the eager logits exactly, also at another
    length."""
    with torch.no_grad():
        eager = model(ids).logits
        for backend in BACKENDS:
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend, fullgraph=True)
            assert torch.equal(compiled(ids).logits, eager), backend
            assert torch.equal(compiled(ids[:, :3]).logits, model(ids[:, :3]).logits), backend


@pytest.mark.parametrize(
    ("scheme", "kwargs"),
    [("int4", {}), ("int4", {"asymmetric": True}), ("nvfp4", {}), ("fp8-block", {})],
)
def test_the_linear_op_passes_opcheck(scheme: str, kwargs: dict) -> None:
    payload = quantize_weight(torch.randn(40, 128), scheme, **kwargs)
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    for x, bias in ((torch.randn(3, 128), None), (torch.randn(2, 4, 128), torch.randn(40))):
        torch.library.opcheck(ops.linear_op, (x, tensors, key, bias), test_utils=_checks(tensors))
    x = torch.randn(3, 128, requires_grad=True)
    torch.library.opcheck(ops.linear_op, (x, tensors, key, None), test_utils=_checks(tensors))


def test_the_w8a8_op_passes_opcheck_and_passes_gradients_straight_through() -> None:
    from qlens.quant.dequantize import dequantize

    payload = quantize_weight(torch.randn(40, 256), "fp8-block")
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    for x, bias in ((torch.randn(3, 256), None), (torch.randn(2, 4, 256), torch.randn(40))):
        torch.library.opcheck(
            ops.w8a8_linear_op, (x, tensors, key, bias), test_utils=_checks(tensors)
        )
    x = torch.randn(3, 256, requires_grad=True)
    torch.library.opcheck(ops.w8a8_linear_op, (x, tensors, key, None), test_utils=_checks(tensors))
    # The activations' FP8 rounding passes the gradient through unchanged: grad @ W.
    (grad,) = torch.autograd.grad(ops.w8a8_linear_op(x, tensors, key, None).sum(), x)
    torch.testing.assert_close(grad, torch.ones(3, 40) @ dequantize(payload, torch.float32))


def _checks(tensors: list[torch.Tensor]) -> tuple[str, ...]:
    """Every opcheck test; the schema test compares inputs with arithmetic that CPU torch lacks
    for float8 tensors, so payloads holding one skip it."""
    fp8 = any(t.dtype == torch.float8_e4m3fn for t in tensors)
    every = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    return every[1:] if fp8 else every


def test_the_experts_op_passes_opcheck() -> None:
    payload = quantize_weight(torch.randn(3, 40, 64), "mxfp4")
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    ids = torch.tensor([2, 0, 2, 1, 0])
    for bias in (None, torch.randn(3, 40)):
        torch.library.opcheck(ops.experts_linear_op, (torch.randn(5, 64), ids, tensors, key, bias))
    x = torch.randn(5, 64, requires_grad=True)
    torch.library.opcheck(ops.experts_linear_op, (x, ids, tensors, key, torch.randn(3, 40)))


def test_op_gradients_match_the_eager_modules() -> None:
    layer = QuantLinear(quantize_weight(torch.randn(40, 64), "int4"), torch.randn(40))
    layer.bias.requires_grad_(True)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).square().sum().backward()
    eager_x, eager_bias = x.grad.clone(), layer.bias.grad.clone()
    x.grad, layer.bias.grad = None, None
    torch.compile(layer, backend="aot_eager")(x).square().sum().backward()
    assert torch.equal(x.grad, eager_x) and torch.equal(layer.bias.grad, eager_bias)


def test_the_experts_op_is_each_rows_expert() -> None:
    from qlens.kernels import reference_linear
    from qlens.quant.expert_payloads import select_expert

    payload = quantize_weight(torch.randn(3, 40, 64), "int4")
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    x, ids, bias = torch.randn(5, 64), torch.tensor([2, 0, 2, 1, 0]), torch.randn(3, 40)
    got = torch.ops.qlens.experts_linear(x, ids, tensors, key, bias)
    for expert in range(3):
        rows = ids == expert  # each expert's rows run as one matmul
        one = reference_linear(x[rows], select_expert(payload, expert), bias[expert])
        assert torch.equal(got[rows], one)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hooks_added_before_compiling_fire_in_the_compiled_model(backend: str) -> None:
    bridge = quantize(Bridge(make_model("llama")), "int4")
    ids = input_ids()
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}
    run = ["eager"]

    def record(x: torch.Tensor, hook) -> None:
        seen[run[0]].append(x.detach().clone())

    def double_mlp_out(x: torch.Tensor, hook) -> torch.Tensor:
        return x * 2

    bridge.add_hook("blocks.0.mlp.hook_pre", record)
    bridge.add_hook("blocks.1.hook_mlp_out", double_mlp_out)
    with torch.no_grad():
        eager = bridge(ids)
        run[0] = "compiled"
        bridge.model.compile(backend=backend)
        compiled = bridge(ids)
    assert len(seen["eager"]) == 1 and len(seen["compiled"]) == 1
    assert torch.equal(seen["compiled"][0], seen["eager"][0])
    assert torch.equal(compiled, eager)
    bridge.reset_hooks()
    with torch.no_grad():
        assert not torch.equal(bridge(ids), eager)  # the edit was real


def test_a_compiled_model_follows_the_bridge_hooks_on_and_off() -> None:
    """A bridge attaches its hooks per call: the graph traced without them must not run while
    they are attached (dynamo skips guarding empty hook dicts unless told otherwise). That each
    hook set's graph is then reused: ``test_compile_hook_guards.py``."""
    bridge = Bridge(make_model("llama"))
    ids = input_ids()
    steering = [("blocks.0.hook_resid_post", lambda x, hook: x + 1.0)]
    with torch.no_grad():
        plain = bridge(ids)
        with bridge.hooks(fwd_hooks=steering):
            steered = bridge(ids)
        bridge.model.compile(backend="eager")
        for on in (True, False, True, False):
            with bridge.hooks(fwd_hooks=steering if on else []):
                assert torch.equal(bridge(ids), steered if on else plain)


def _rerouted_fp8_holder() -> torch.nn.Sequential:
    """A transformers ``FP8Linear`` (128 -> 64, one block scale) in a holder, rerouted."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    layer = FP8Linear(128, 64, block_size=(128, 128), has_bias=True)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(64, 128) * 60).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(1, 1) * 1e-3 + 1e-4)
        layer.bias.copy_(torch.randn(64))  # transformers leaves it uninitialised
    holder = torch.nn.Sequential(layer)
    reroute_quantized_modules(holder, force=True)
    return holder


def test_rerouted_fp8_linear_compiles_before_any_eager_call() -> None:
    holder = _rerouted_fp8_holder()
    x = torch.randn(2, 128)
    compiled = torch.compile(holder, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, holder(x))


def _fp8_flipped(weight: torch.Tensor, dim: int) -> torch.Tensor:
    return weight.detach().view(torch.uint8).flip(dim).view(torch.float8_e4m3fn)


def test_a_compiled_rerouted_linear_reads_its_tensors_after_they_change() -> None:
    """Edits in place, conversions that replace a tensor's data (``_apply``) and assigned
    tensors all reach the compiled graph; a tensor written into ``_parameters`` directly is
    refused in a whole-graph trace (qlens cannot check it there) until an eager call reads it."""
    torch._dynamo.reset()  # a fresh recompile budget for Sequential.forward
    holder = _rerouted_fp8_holder()
    layer, x = holder[0], torch.randn(2, 128)
    compiled = torch.compile(holder, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        first = compiled(x)
        layer.weight.copy_(_fp8_flipped(layer.weight, 0))
        assert torch.equal(compiled(x), holder(x)) and not torch.equal(first, holder(x))
        holder._apply(lambda t: t.clone())  # same tensor objects, new data
        layer.weight.copy_(_fp8_flipped(layer.weight, 1))
        assert torch.equal(compiled(x), holder(x))
        layer.weight = torch.nn.Parameter(_fp8_flipped(layer.weight, 0), requires_grad=False)
        assert torch.equal(compiled(x), holder(x))
        layer._parameters["weight"] = torch.nn.Parameter(
            _fp8_flipped(layer.weight, 1), requires_grad=False
        )
        with pytest.raises(Exception, match="Observed exception"):
            compiled(x)
        eager = holder(x)  # reads it again
        assert torch.equal(compiled(x), eager)


def test_tensors_of_a_rerouted_linear_can_be_replaced_one_at_a_time() -> None:
    """A weight of another width assigned before its scales: the assignment stands, a forward
    in between says what is wrong, and the module runs once the scales follow."""
    holder = _rerouted_fp8_holder()
    layer, x = holder[0], torch.randn(2, 256)
    weight = (torch.randn(64, 256) * 60).to(torch.float8_e4m3fn)
    with torch.no_grad():
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        with pytest.raises(ValueError, match=r"`scales` must have shape \[1, 2\], got \[1, 1\]"):
            holder(x)
        scales = torch.rand(1, 2) * 1e-3 + 1e-4
        layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
        expected = x @ (weight.float() * scales.repeat_interleave(128, 1)).T + layer.bias
        assert torch.allclose(holder(x), expected, rtol=1e-5, atol=1e-4)


class _Builds:
    """Payloads and launch plans constructed, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import qlens.kernels.experts as kernel_experts
        import qlens.kernels.plan as plan
        from qlens.quant.payload import QuantPayload

        self.count = 0
        for owner, name in ((QuantPayload, "__init__"), (plan.LinearPlan, "__init__"),
                            (kernel_experts.ExpertsPlan, "__init__")):  # fmt: skip
            original = getattr(owner, name)

            def counted(obj, *args, _original=original, **kwargs):
                self.count += 1
                _original(obj, *args, **kwargs)

            monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize(("family", "scheme"), [("llama", "int4"), ("qwen3_moe", "mxfp4")])
def test_compiled_calls_build_no_payload_or_plan(family: str, scheme: str, monkeypatch) -> None:
    """Outside CUDA graphs a compiled graph runs the ops' bodies on every call: they reach the
    modules' kept payloads and plans by their tensors, also when no eager call ran first and
    after a device move."""
    model = quantize(make_model(family), scheme).to("cpu")
    builds = _Builds(monkeypatch)
    ids = input_ids()
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        first = compiled(ids).logits
        after_first = builds.count
        for _ in range(3):
            assert torch.equal(compiled(ids).logits, first)
    assert builds.count == after_first
    assert torch.equal(first, model(ids).logits)


def test_rerouted_linear_compiled_calls_build_no_payload(monkeypatch) -> None:
    compiled = torch.compile(_rerouted_fp8_holder(), backend="aot_eager")
    x = torch.randn(2, 128)
    first = compiled(x)
    builds = _Builds(monkeypatch)
    for _ in range(3):
        assert torch.equal(compiled(x), first)
    assert builds.count == 0


def test_ops_take_the_offered_payload_only_for_its_own_tensors() -> None:
    import gc

    from qlens.kernels.op_payloads import offer_to_ops, payload_for_op

    payload = quantize_weight(torch.randn(32, 64), "int4")
    tensors = list(payload.tensors().values())
    key = PayloadSpec.of(payload).key
    offer_to_ops(payload, tensors, key)
    assert payload_for_op(key, tensors) is payload
    clones = [t.clone() for t in tensors]
    other = payload_for_op(key, clones)  # equal values, other tensors: built from them
    assert other is not payload and other.data is clones[0]
    wider = PayloadSpec.of(quantize_weight(torch.randn(32, 128), "int4")).key
    assert payload_for_op(wider, tensors) is not payload  # another spec: built, not offered
    del payload
    gc.collect()  # the offer lasts only as long as its payload
    assert payload_for_op(key, tensors).data is tensors[0]


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_rerouted_bitsandbytes_linear_compiles_to_the_eager_output(nested: bool) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(128, 64, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(
        torch.randn(64, 128) * 0.02, requires_grad=False, quant_type="nf4",
        compress_statistics=nested, module=layer,
    ).to("cpu")  # fmt: skip
    holder = torch.nn.Sequential(layer)
    assert reroute_quantized_modules(holder, force=True) == ["0"]
    x = torch.randn(3, 128)
    compiled = torch.compile(holder, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, holder(x))


def test_rerouted_bitsandbytes_int8_linear_compiles_to_the_eager_output() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear8bitLt(128, 64, bias=True, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(
        torch.randn(64, 128) * 0.02, requires_grad=False, has_fp16_weights=False
    ).to("cpu")
    holder = torch.nn.Sequential(layer)
    assert reroute_quantized_modules(holder, force=True) == ["0"]
    x = torch.randn(3, 128)
    compiled = torch.compile(holder, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, holder(x))
