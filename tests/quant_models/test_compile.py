"""``torch.compile`` over quantized models on the CPU: one ``qlens::`` op per quantized linear or
experts projection, no graph break, the eager logits, hooks still firing."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import input_ids, make_model

from qlens.bridge import Bridge
from qlens.kernels import ops
from qlens.modules import QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.reroute import reroute_quantized_modules
from qlens.quant.payload_spec import PayloadSpec
from qlens.quant.quantize import quantize_weight

# The dense MoE family and three linear schemes, plus fused experts in three formats.
CASES = [("llama", "int4"), ("llama", "nvfp4"), ("llama", "fp8-block")]
# Fused experts compile in a fresh interpreter (compile_check.py says why).
MOE_CHECKS = [
    ["model", "qwen3_moe", "mxfp4"],
    ["model", "mixtral", "int8"],
    ["model", "gpt_oss", "nvfp4"],
    ["experts"],
    ["rerouted_gpt_oss"],
]
BACKENDS = ["eager", "aot_eager"]


def _type_checked(fn: object) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and "jaxtyping" in code.co_filename and hasattr(fn, "__wrapped__")


@pytest.fixture(autouse=True)
def _as_users_run_it(monkeypatch: pytest.MonkeyPatch):
    """qlens' functions without the runtime type checks that tests/conftest.py wraps them in
    (beartype cannot check the fake tensors torch.compile traces with); fresh dynamo caches."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("qlens") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if _type_checked(value):
                monkeypatch.setattr(module, attr, inspect.unwrap(value))
            elif inspect.isclass(value) and value.__module__ == name:
                for method, fn in list(vars(value).items()):
                    if _type_checked(fn):
                        monkeypatch.setattr(value, method, inspect.unwrap(fn))
                    elif isinstance(fn, property) and _type_checked(fn.fget):
                        unwrapped = property(inspect.unwrap(fn.fget), fn.fset, fn.fdel, fn.__doc__)
                        monkeypatch.setattr(value, method, unwrapped)
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


@pytest.mark.parametrize("check", MOE_CHECKS, ids="-".join)
def test_fused_experts_compile_with_no_graph_break(check: list[str]) -> None:
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)])}
    done = subprocess.run(
        [sys.executable, str(here / "compile_check.py"), *check],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compile check passed" in done.stdout


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


def test_rerouted_fp8_linear_compiles_before_any_eager_call() -> None:
    from transformers.integrations.finegrained_fp8 import FP8Linear

    layer = FP8Linear(128, 64, block_size=(128, 128), has_bias=True)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(64, 128) * 60).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(1, 1) * 1e-3 + 1e-4)
    holder = torch.nn.Sequential(layer)
    reroute_quantized_modules(holder, force=True)
    x = torch.randn(2, 128)
    compiled = torch.compile(holder, backend="aot_eager")(x)
    assert torch.equal(compiled, holder(x))
