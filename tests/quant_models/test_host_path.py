"""What an eager forward of a quantized module does on the host: the payload, its checks, the
launch choice and the launch's arguments happen once; later calls only launch (one Triton launch
a linear on the decode path, through the direct launcher). Rebuilt once after ``.to()`` or
``load_state_dict``, and still exact. The kernels run in Triton's interpreter here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_route import accelerate_experts_plans
from tiny_models import make_model

import qlens.kernels.dispatch as dispatch
import qlens.kernels.experts as kernel_experts
import qlens.kernels.fast_launch as fast_launch
import qlens.kernels.gemv as gemv
import qlens.kernels.plan as plan
import qlens.kernels.weights as weights
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.runtime import interpreting
from qlens.kernels.weight_only import _WEIGHT_ONLY
from qlens.kernels.weights import unsupported_reason
from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.payload_buffers import PayloadModule
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="runs the kernels on CPU tensors (TRITON_INTERPRET=1)"
)
CALLS = 4


class Counts:
    """Calls of the host-side steps a forward must not repeat."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.payloads = self.checks = self.configs = self.routes = 0
        init = QuantPayload.__init__
        checked_view = weights._checked_view
        weight_config = dispatch._weight_config

        def count_payload(payload, *args, **kwargs):
            self.payloads += 1
            init(payload, *args, **kwargs)

        def count_check(payload):
            self.checks += 1
            return checked_view(payload)

        def count_config(*args, **kwargs):
            self.configs += 1
            return weight_config(*args, **kwargs)

        def kernel_route(payload, device):
            """The kernels for every payload they read (the CPU runs the reference otherwise)."""
            self.routes += 1
            return ("kernel" if unsupported_reason(payload) is None else "reference"), None

        monkeypatch.setattr(QuantPayload, "__init__", count_payload)
        monkeypatch.setattr(weights, "_checked_view", count_check)
        monkeypatch.setattr(dispatch, "_weight_config", count_config)
        monkeypatch.setattr(plan, "_weight_config", count_config)
        monkeypatch.setattr(plan, "choose_route", kernel_route)

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.payloads, self.checks, self.configs, self.routes


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    return Counts(monkeypatch)


def _linear(scheme: str = "int4") -> tuple[QuantLinear, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(48, 96)
    return QuantLinear(quantize_weight(weight, scheme), torch.randn(48)), torch.randn(2, 96)


def _expected(module: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), dequantize(module.payload, torch.float64), module.bias.double())


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "fp8-block"])
def test_quant_linear_prepares_once_then_only_launches(scheme: str, counts: Counts) -> None:
    module, x = _linear(scheme)
    first = module(x)
    after_first = counts.snapshot()
    assert after_first[1:] == (1, 1, 1)  # one check, one launch choice, one route
    for _ in range(CALLS):
        assert torch.equal(module(x), first)
    assert counts.snapshot() == after_first  # no payload built, checked or planned again
    # fp32 activations: the kernel's fp32 dot against the float64 product (K = 96)
    assert _rel_err(first, _expected(module, x)) < 1e-5


def test_a_new_row_count_chooses_one_more_launch_only(counts: Counts) -> None:
    module, x = _linear()
    module(x)
    module(torch.randn(3, 96))
    module(torch.randn(3, 96))
    assert counts.snapshot()[1:] == (1, 2, 1)


def test_device_move_and_state_dict_load_rebuild_once(counts: Counts) -> None:
    module, x = _linear()
    module(x)
    before = counts.snapshot()
    module.to("cpu")  # _apply, as on any device move
    module(x)
    module(x)
    assert counts.snapshot()[1] == before[1] + 1  # checked again once
    other, _ = _linear()
    other.payload.data.copy_(torch.roll(other.payload.data, 1, 0))
    module.load_state_dict(other.state_dict())
    mid = counts.snapshot()
    got = module(x)
    assert counts.snapshot()[1] == mid[1] + 1
    module(x)
    assert counts.snapshot()[1] == mid[1] + 1
    assert _rel_err(got, _expected(other, x)) < 1e-5


def test_float64_activations_take_the_reference(counts: Counts) -> None:
    module, x = _linear()
    module.double()  # the bias; payload buffers keep their dtypes
    got = module(x.double())
    assert got.dtype == torch.float64
    assert _rel_err(got, _expected(module, x)) < 1e-12


def test_a_replaced_buffer_rebuilds_the_payload(counts: Counts) -> None:
    """Device maps and offloading hooks swap buffers in place of others, bypassing ``_apply``."""
    module, x = _linear()
    module(x)
    before = counts.snapshot()
    module._buffers["weight_scales"] = module._buffers["weight_scales"] * 2
    got = module(x)
    assert counts.snapshot()[:2] == (before[0] + 1, before[1] + 1)
    assert _rel_err(got, _expected(module, x)) < 1e-5


def test_quant_experts_prepare_every_expert_once(counts: Counts) -> None:
    model = quantize(make_model("qwen3_moe"), "int4")
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, QuantExperts)
    x = torch.randn(6, 128)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights_ = torch.rand(6, 2)
    with torch.no_grad():
        first = experts(x, index, weights_)
        after_first = counts.snapshot()
        # gate_up and down of every expert, and each payload's stacked view (one-launch GEMV)
        assert after_first[1] == 2 * experts.num_experts + 2
        for _ in range(CALLS):
            assert torch.equal(experts(x, index, weights_), first)
    assert counts.snapshot() == after_first


def _fp8_linear_holder() -> tuple[torch.nn.Module, torch.nn.Sequential]:
    """A transformers ``FP8Linear`` [64, 128] with a bias, in a container."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    layer = FP8Linear(128, 64, block_size=(128, 128), has_bias=True)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(64, 128) * 60).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(1, 1) * 1e-3 + 1e-4)
        layer.bias.copy_(torch.randn(64))
    holder = torch.nn.Sequential(layer)
    return layer, holder


def test_rerouted_module_adopts_and_prepares_once(counts: Counts, monkeypatch) -> None:
    import qlens.quant.adopt as adopt
    from qlens.modules.reroute import reroute_quantized_modules

    adoptions: list[str] = []
    adopt_module = adopt.adopt_module

    def count_adoption(module):
        adoptions.append(type(module).__name__)
        return adopt_module(module)

    monkeypatch.setattr(adopt, "adopt_module", count_adoption)
    layer, holder = _fp8_linear_holder()
    assert reroute_quantized_modules(holder, force=True) == ["0"]
    x = torch.randn(2, 128)
    first = holder(x)
    after_first = counts.snapshot()
    assert adoptions == ["FP8Linear"] and after_first[1:] == (1, 1, 1)
    for _ in range(CALLS):
        assert torch.equal(holder(x), first)
    assert counts.snapshot() == after_first and adoptions == ["FP8Linear"]
    weight = layer.weight.float() * layer.weight_scale_inv
    expected = F.linear(x.double(), weight.double(), layer.bias.double())
    assert _rel_err(first, expected) < 1e-5


class DirectLaunches:
    """Every ``FastLaunch`` and prepared launch takes its direct path, over Triton's interpreter.

    A normal launch (a launch key seen for the first time) runs the interpreted kernel and
    keeps a stand-in compiled kernel whose ``run`` launches it again with exactly the arguments
    the direct path passes (tensors as their addresses, mapped back to the tensors launched), so
    results stay checked. Counts the normal launches and every Triton launch
    (``InterpretedFunction.run``, whatever path made it).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self.normal = self.launches = 0
        run = InterpretedFunction.run
        signatures: dict[object, JITFunction] = {}
        by_address: dict[int, torch.Tensor] = {}
        prepared_call = fast_launch.PreparedLaunch.__call__

        def count_run(kernel, *args, **kwargs):
            self.launches += 1
            return run(kernel, *args, **kwargs)

        def first_launch(launcher, grid, args, options):
            self.normal += 1
            launcher.kernel[grid](*args, **options)
            fn = launcher.kernel.fn
            jit = signatures.setdefault(fn, JITFunction(fn))  # the kernel's parameters
            tensors = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
            stand_in = _InterpretedCompiled(launcher.kernel, tensors, by_address)
            return stand_in, fast_launch._tail_arguments(jit, args, options)

        def remember_tensors(launch, *tensors):
            for tensor in launch.arguments(*tensors):
                if isinstance(tensor, torch.Tensor):
                    by_address[tensor.data_ptr()] = tensor
            return prepared_call(launch, *tensors)

        monkeypatch.setattr(fast_launch.PreparedLaunch, "__call__", remember_tensors)
        monkeypatch.setattr(InterpretedFunction, "run", count_run)
        for launcher in (gemv.PACKED_GEMV, gemv._GEMV, _WEIGHT_ONLY):  # no kernel kept yet
            monkeypatch.setattr(launcher, "_compiled", {})
        monkeypatch.setattr(FastLaunch, "runtime", lambda launcher: _DEVICE_ZERO)
        monkeypatch.setattr(FastLaunch, "_first_launch", first_launch)

    def snapshot(self) -> tuple[int, int]:
        return self.normal, self.launches


class _InterpretedCompiled:
    """``CompiledKernel.run``'s call, run by the interpreter."""

    function = "interpreted"
    packed_metadata = ()

    def __init__(self, kernel, tensors: list[int], by_address: dict[int, torch.Tensor]) -> None:
        self.kernel, self.tensors, self.by_address = kernel, tensors, by_address

    def launch_metadata(self, *args) -> None:
        raise AssertionError("no launch hook is set")

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args) -> None:
        assert (stream, function, metadata, enter, exit_) == (7, "interpreted", None, None, None)
        resolved = list(args)
        for i in self.tensors:
            assert type(args[i]) is int, "direct launches pass tensors as addresses"
            resolved[i] = self.by_address[args[i]]
        self.kernel[(g0, g1, g2)](*resolved)


class _DeviceZero:
    def current_device(self) -> int:
        return 0

    def current_stream(self, device: int) -> int:
        return 7

    def hooks(self) -> tuple[None, None]:
        return None, None


_DEVICE_ZERO = _DeviceZero()


class Lookups:
    """Calls of the per-call work a kept plan saves: the module's buffer walk and the lookups
    of what is kept on a payload."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        payload_for = PayloadModule.payload_for
        cached = weights.cached_on_payload

        def count_payload_for(module, prefix):
            self.calls += 1
            return payload_for(module, prefix)

        def count_cached(*args, **kwargs):
            self.calls += 1
            return cached(*args, **kwargs)

        monkeypatch.setattr(PayloadModule, "payload_for", count_payload_for)
        for module in (weights, plan, kernel_experts):
            monkeypatch.setattr(module, "cached_on_payload", count_cached)


@pytest.mark.parametrize(
    ("scheme", "kernel"),
    [("int4", "packed"), ("nvfp4", "packed"), ("int4-asym", "packed"), ("fp8-block", "byte")],
)
def test_quant_linear_decode_call_is_one_direct_launch(
    scheme: str, kernel: str, counts: Counts, monkeypatch
) -> None:
    """After the first one-token call: no payload built, checked, planned or looked up, no
    launch key missed, and one Triton launch (no regrouping kernel, no split reduction)."""
    torch.manual_seed(0)
    options = {"asymmetric": True, "group_size": 32} if scheme == "int4-asym" else {}
    payload = quantize_weight(torch.randn(48, 96), scheme.removesuffix("-asym"), **options)
    module = QuantLinear(payload, torch.randn(48))
    x = torch.randn(1, 96)
    normal = module(x)  # the interpreter's own launch
    module.forget_prepared()
    direct, lookups = DirectLaunches(monkeypatch), Lookups(monkeypatch)
    prepared = gemv.PackedGemv if kernel == "packed" else gemv.ByteGemv
    built: list[object] = []
    monkeypatch.setattr(prepared, "__init__", _counting(prepared.__init__, built))
    first = module(x)
    assert torch.equal(first, normal) and len(built) == 1
    after_first, launched = counts.snapshot(), direct.snapshot()
    assert launched == (1, 1)  # one key, one launch
    lookups.calls = 0
    for call in range(1, CALLS + 1):
        assert torch.equal(module(x), normal)
        assert direct.snapshot() == (1, 1 + call)  # one direct launch a call, no key missed
    assert counts.snapshot() == after_first and lookups.calls == 0 and len(built) == 1
    assert _rel_err(first, _expected(module, x)) < 1e-5


def _counting(init, built: list[object]):
    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    return counted


def test_a_new_row_count_or_dtype_prepares_one_more_launch(counts: Counts, monkeypatch) -> None:
    module, _ = _linear()
    direct = DirectLaunches(monkeypatch)
    for rows, dtype in ((1, torch.float32), (1, torch.bfloat16), (3, torch.float32)):
        x = torch.randn(rows, 96).to(dtype)
        before = direct.normal
        first = module(x)
        assert direct.normal == before + 1
        # Rows on tensor cores: regrouped in the first call (compiling the launch CUDA graphs
        # capture), as they are from the second on (its own compile), direct after that.
        compiles = 1 if rows == 1 else 2
        for _ in range(2):
            assert torch.equal(module(x), first) and direct.normal == before + compiles
    module(torch.randn(3, 96).bfloat16())
    assert counts.snapshot()[1:] == (1, 2, 1)  # one check, one launch choice per row count


@pytest.mark.parametrize("fused", (False, True), ids=("unfused", "fused"))
def test_quant_experts_decode_is_two_direct_launches(
    fused: bool, counts: Counts, monkeypatch
) -> None:
    """A one-token call of silu experts launches twice and prepares or looks up nothing after
    the first: on an accelerator (taken here by the CPU's plans) the fused MoE decode (gate|up
    with the activation, then down with the weighted sum); with only the one-launch rows, the
    word-wise GEMV once a projection."""
    import qlens.kernels.moe_decode as moe_decode
    from qlens.kernels.experts import ExpertsPlan

    model = quantize(make_model("qwen3_moe"), "int4")
    experts = model.get_submodule("model.layers.0.mlp.experts")
    x = torch.randn(1, 128)
    index, weights_ = torch.tensor([[2, 0]]), torch.tensor([[0.7, 0.3]])
    with torch.no_grad():
        loop = experts(x, index, weights_)  # the expert loop (the CPU's choice)
        if fused:
            accelerate_experts_plans(monkeypatch)
        else:
            monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: True)
        experts.forget_prepared()
        direct, lookups = DirectLaunches(monkeypatch), Lookups(monkeypatch)
        for launcher in (moe_decode._GATE_UP, moe_decode._DOWN_SUM):
            monkeypatch.setattr(launcher, "_compiled", {})
        first = experts(x, index, weights_)
        after_first, launched = counts.snapshot(), direct.snapshot()
        # one normal launch per key: the fused decode's two kernels, or the GEMV's (the two
        # projections share one when Triton would specialize them alike)
        keys = 2 if fused else len(gemv.PACKED_GEMV.cached_keys())
        assert launched == (keys, 2) and keys in (1, 2)
        assert len(moe_decode._DOWN_SUM.cached_keys()) == fused  # the fused kernels ran, or not
        lookups.calls = 0
        for call in range(1, CALLS + 1):
            assert torch.equal(experts(x, index, weights_), first)
            assert direct.snapshot() == (keys, 2 + 2 * call)
    assert counts.snapshot() == after_first and lookups.calls == 0
    torch.testing.assert_close(first, loop, atol=1e-5, rtol=1e-5)


def test_rerouted_linear_decode_call_is_one_direct_launch(counts: Counts, monkeypatch) -> None:
    from qlens.modules.reroute import reroute_quantized_modules

    _, holder = _fp8_linear_holder()
    reroute_quantized_modules(holder, force=True)
    x = torch.randn(1, 128)
    direct, lookups = DirectLaunches(monkeypatch), Lookups(monkeypatch)
    first = holder(x)
    after_first = counts.snapshot()
    assert direct.snapshot() == (1, 1)
    lookups.calls = 0
    for call in range(1, CALLS + 1):
        assert torch.equal(holder(x), first)
        assert direct.snapshot() == (1, 1 + call)
    assert counts.snapshot() == after_first and lookups.calls == 0
    with pytest.raises(RuntimeError, match=r"FP8Linear: input is on meta but its quantized"):
        holder(torch.empty(1, 128, device="meta"))


def test_an_input_on_another_device_than_the_kept_plan_raises() -> None:
    module, x = _linear()
    module(x)  # the plan is kept for the CPU
    with pytest.raises(RuntimeError, match=r"QuantLinear: input is on meta but its quantized"):
        module(torch.empty(2, 96, device="meta"))
    model = quantize(make_model("qwen3_moe"), "int4")
    experts = model.get_submodule("model.layers.0.mlp.experts")
    index, weights_ = torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]])
    with torch.no_grad():
        experts(torch.randn(1, 128), index, weights_)
        with pytest.raises(RuntimeError, match=r"QuantExperts: input is on meta but its"):
            experts(torch.empty(1, 128, device="meta"), index, weights_)


def test_a_k_split_decode_call_is_the_gemv_and_its_reduction(counts: Counts, monkeypatch) -> None:
    from qlens.kernels import LinearConfig

    module, _ = _linear()
    split = LinearConfig("gemv", 16, 16, 32, split_k=2)  # K = 96: three steps over two splits
    monkeypatch.setattr(plan, "_weight_config", lambda *args, **kwargs: split)
    direct = DirectLaunches(monkeypatch)
    x = torch.randn(1, 96)
    first = module(x)
    for _ in range(CALLS):
        assert torch.equal(module(x), first)
    # the partials' sum is its own launch, prepared once like the GEMV's: two first launches
    assert direct.snapshot() == (2, 2 * (CALLS + 1))
    assert _rel_err(first, _expected(module, x)) < 1e-5
