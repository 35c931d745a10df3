"""What an eager forward of a quantized module does on the host: the payload, its checks and the
launch choice happen once; later calls only launch. Rebuilt once after ``.to()`` or
``load_state_dict``, and still exact. The kernels run in Triton's interpreter here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model

import qlens.kernels.dispatch as dispatch
import qlens.kernels.plan as plan
import qlens.kernels.weights as weights
from qlens.kernels.runtime import interpreting
from qlens.kernels.weights import unsupported_reason
from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.model_quantize import quantize
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


def test_rerouted_module_adopts_and_prepares_once(counts: Counts, monkeypatch) -> None:
    from transformers.integrations.finegrained_fp8 import FP8Linear

    import qlens.quant.adopt as adopt
    from qlens.modules.reroute import reroute_quantized_modules

    adoptions: list[str] = []
    adopt_module = adopt.adopt_module

    def count_adoption(module):
        adoptions.append(type(module).__name__)
        return adopt_module(module)

    monkeypatch.setattr(adopt, "adopt_module", count_adoption)
    layer = FP8Linear(128, 64, block_size=(128, 128), has_bias=True)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(64, 128) * 60).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(1, 1) * 1e-3 + 1e-4)
        layer.bias.copy_(torch.randn(64))
    holder = torch.nn.Sequential(layer)
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
