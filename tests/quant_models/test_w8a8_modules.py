"""W8A8 (FP8 activations) on block-FP8 QuantLinears: the numerics, the model-wide switch, the
kernel route, torch.compile and save/reload."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_experts import random_fp8_experts
from tiny_models import input_ids, make_model

import qlens
from qlens.kernels import plan as plan_module
from qlens.kernels.reference import reference_w8a8_linear
from qlens.modules import QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.serialization import load_quantized, save_quantized
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight


def _weight(n: int = 96, k: int = 320, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def deepseek_w8a8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The FP8 checkpoints' reference forward, written from its definition with torch's own
    e4m3 cast: per token and block of 128 along K, ``s = amax / 448`` (1 for an all-zero
    block), codes ``x / s`` cast to e4m3; then the float matmul with the dequantized weight."""
    rows = x.reshape(-1, x.shape[-1]).float()
    k = rows.shape[-1]
    padded = F.pad(rows, (0, -k % 128)).unflatten(-1, (-1, 128))
    scale = padded.abs().amax(-1, keepdim=True) / 448.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (padded / scale).to(torch.float8_e4m3fn)
    rounded = (codes.float() * scale).flatten(-2)[:, :k]
    return F.linear(rounded, weight, bias).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("scale_dtype", [None, "e8m0"])
def test_w8a8_linear_is_the_fp8_checkpoints_forward(scale_dtype: str | None) -> None:
    payload = quantize_weight(_weight(), "fp8-block", scale_dtype=scale_dtype)
    bias = _x(96, seed=2)
    layer = QuantLinear(payload, bias, w8a8=True)
    x = _x(2, 3, 320) * torch.logspace(-3, 2, 320)  # blocks of very different magnitudes
    x[0, 1, :128] = 0.0  # an all-zero block
    out = layer(x)
    assert torch.equal(out, reference_w8a8_linear(x, payload, bias))
    expected = deepseek_w8a8(x, dequantize(payload, torch.float32), bias)
    # The same FP8 activations; only the float32 matmul's summation order may differ.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    weight_only = F.linear(x, dequantize(payload, torch.float32), bias)
    assert not torch.allclose(out, weight_only, rtol=1e-3, atol=0)  # the activations did round


def test_w8a8_is_a_switch_on_the_same_weights() -> None:
    payload = quantize_weight(_weight(), "fp8-block")
    layer = QuantLinear(payload)
    x = _x(4, 320)
    weight_only = layer(x)
    assert torch.equal(weight_only, F.linear(x, dequantize(payload, torch.float32)))
    layer.w8a8 = True
    assert "w8a8=True" in repr(layer)
    assert torch.equal(layer(x), reference_w8a8_linear(x, payload))
    layer.w8a8 = False
    assert torch.equal(layer(x), weight_only)
    assert "w8a8" not in repr(layer)


def test_w8a8_refuses_other_formats_naming_them() -> None:
    with pytest.raises(ValueError, match=r"runs fp8_block weights only; this weight is int4"):
        QuantLinear(quantize_weight(_weight(), "int4"), w8a8=True)
    layer = QuantLinear(quantize_weight(_weight(), "mxfp8"))
    with pytest.raises(ValueError, match=r"this weight is mxfp8\. Run it weight-only"):
        layer.w8a8 = True
    assert not layer.w8a8
    with pytest.raises(ValueError, match="runs fp8_block weights only"):
        plan_module.LinearPlan(quantize_weight(_weight(), "nvfp4"), torch.device("cpu"), w8a8=True)


def test_set_w8a8_switches_every_block_fp8_linear_of_a_model() -> None:
    model = quantize(make_model("llama"), "fp8-block")
    ids = input_ids()
    with torch.no_grad():
        weight_only = model(ids).logits
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert qlens.set_w8a8(model) == len(linears) == 14
        assert all(m.w8a8 for m in linears)
        w8a8 = model(ids).logits
        # Every linear runs the W8A8 reference: the same logits as layers that call it directly.
        originals = {m: m.forward for m in linears}
        for m in linears:
            m.forward = lambda x, m=m: reference_w8a8_linear(x, m.payload, m.bias)
        assert torch.equal(model(ids).logits, w8a8)
        for m, forward in originals.items():
            m.forward = forward
        assert not torch.equal(w8a8, weight_only)
        assert qlens.set_w8a8(qlens.load(model), enabled=False) == 14  # through a Bridge too
        assert torch.equal(model(ids).logits, weight_only)


def test_set_w8a8_on_a_model_without_block_fp8_is_an_error() -> None:
    model = quantize(make_model("llama"), "int4")
    with pytest.raises(ValueError, match=r"no blocked fp8_block linear .*'fp8-block'"):
        qlens.set_w8a8(model)
    with pytest.raises(TypeError, match="expects an nn.Module or a qlens Bridge; got str"):
        qlens.set_w8a8("model")


def _fp8_linear_holder() -> tuple[torch.nn.Module, torch.nn.Sequential, torch.Tensor]:
    """A transformers ``FP8Linear`` [64, 256] (two 128 x 128 scale blocks) with a bias, in a
    container, and its float weight."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    layer = FP8Linear(256, 64, block_size=(128, 128), has_bias=True)
    with torch.no_grad():
        layer.weight.copy_((_x(64, 256) * 60).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(1, 2) * 1e-3 + 1e-4)
        layer.bias.copy_(_x(64, seed=5))
    weight = layer.weight.float() * layer.weight_scale_inv.repeat_interleave(128, dim=1)
    return layer, torch.nn.Sequential(layer), weight


@pytest.mark.parametrize("how", ["rerouted", "converted"])
def test_a_transformers_fp8_linear_runs_w8a8(how: str) -> None:
    """transformers' own W8A8 forward needs CUDA kernels from the hub. Rerouted by a Bridge
    (or converted to a QuantLinear), the same e4m3 weight and block scales run W8A8 here."""
    from qlens.modules.convert import to_quant_linears
    from qlens.modules.reroute import reroute_quantized_modules

    layer, holder, weight = _fp8_linear_holder()
    with pytest.raises(ValueError, match="no blocked fp8_block linear"):
        qlens.set_w8a8(holder)  # its own forward: nothing qlens runs
    if how == "rerouted":
        assert reroute_quantized_modules(holder) == ["0"]
    else:
        assert to_quant_linears(holder) == ["0"]
    x = _x(5, 256, seed=6)
    with torch.no_grad():
        weight_only = holder(x)
        assert qlens.set_w8a8(holder) == 1
        out = holder(x)
        expected = deepseek_w8a8(x, weight, layer.bias.float())
        torch.testing.assert_close(
            out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
        )
        compiled = torch.compile(holder, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), out)
        assert qlens.set_w8a8(holder, enabled=False) == 1
        assert torch.equal(holder(x), weight_only)
    torch._dynamo.reset()


def test_per_tensor_fp8_has_no_activation_block() -> None:
    from qlens.quant.adopt.fp8 import fp8_payload

    weight = (_x(64, 256) * 60).to(torch.float8_e4m3fn)
    payload = fp8_payload(weight, torch.tensor(1e-3), None)  # one scale for the matrix
    assert payload.format.block == (64, 256)
    with pytest.raises(ValueError, match=r"one scale for the whole matrix \(per-tensor\)"):
        QuantLinear(payload, w8a8=True)
    holder = torch.nn.Sequential(
        QuantLinear(payload), QuantLinear(quantize_weight(_weight(n=64, k=64), "fp8-block"))
    )
    assert qlens.set_w8a8(holder) == 1  # the blocked one only
    assert not holder[0].w8a8 and holder[1].w8a8


def test_w8a8_survives_save_and_reload(tmp_path) -> None:
    model = quantize(make_model("llama"), "fp8-block")
    qlens.set_w8a8(model)
    model.model.layers[0].self_attn.q_proj.w8a8 = False  # one layer left weight-only
    save_quantized(model, tmp_path)
    again = load_quantized(tmp_path)
    flags = {n: m.w8a8 for n, m in again.named_modules() if isinstance(m, QuantLinear)}
    assert flags.pop("model.layers.0.self_attn.q_proj") is False
    assert all(flags.values()) and len(flags) == 13
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_w8a8_kernel_route_matches_the_reference(monkeypatch) -> None:
    """The Triton W8A8 path (interpreter on the CPU) through the module: the same FP8
    activations as the reference (bit-exact, ``test_w8a8.py``), products summed in float32
    in another order; the split-K decode launch for few rows, the GEMM for many."""
    monkeypatch.setattr(plan_module, "choose_route", lambda payload, device: ("kernel", None))
    payload = quantize_weight(_weight(n=64, k=256), "fp8-block")
    bias = _x(64, seed=3)
    layer = QuantLinear(payload, bias, w8a8=True)
    for rows in (1, 80):
        x = _x(rows, 256, seed=rows)
        out = layer(x)
        expected = reference_w8a8_linear(x, payload, bias)
        torch.testing.assert_close(
            out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
        )
    kept = layer._plans["weight"][1]
    assert isinstance(kept, plan_module.LinearPlan) and kept.w8a8 and kept.route == "kernel"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_w8a8_model_gives_the_eager_logits(backend: str) -> None:
    torch._dynamo.reset()
    model = quantize(make_model("llama"), "fp8-block")
    ids = input_ids()
    with torch.no_grad():
        weight_only = model(ids).logits
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        assert torch.equal(compiled(ids).logits, weight_only)
        qlens.set_w8a8(model)  # the traced flag changed: the compiled model recompiles
        eager = model(ids).logits
        assert not torch.equal(eager, weight_only)
        assert torch.equal(compiled(ids).logits, eager)
    torch._dynamo.reset()


def test_w8a8_experts_round_each_projections_input() -> None:
    from qlens.modules import QuantExperts
    from qlens.modules.expert_gate import ExpertGate

    gen = torch.Generator().manual_seed(7)
    gate_up = quantize_weight(torch.randn(4, 2 * 128, 256, generator=gen) * 0.05, "fp8-block")
    down = quantize_weight(torch.randn(4, 256, 128, generator=gen) * 0.05, "fp8-block")
    experts = QuantExperts(gate_up, down, ExpertGate("stacked", "silu"), w8a8=True)
    assert "w8a8=True" in repr(experts)
    x = _x(6, 256, seed=8) * torch.logspace(-2, 1, 256)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2, generator=gen)
    out = experts(x, index, weights)
    w_gate_up, w_down = dequantize(gate_up, torch.float32), dequantize(down, torch.float32)
    expected = torch.zeros(6, 256)
    for t in range(6):
        for j in range(2):
            e = int(index[t, j])
            h = experts.gate.apply(deepseek_w8a8(x[t : t + 1], w_gate_up[e], None))
            expected[t] += weights[t, j] * deepseek_w8a8(h, w_down[e], None)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    experts.w8a8 = False
    weight_only = experts(x, index, weights)
    assert not torch.allclose(weight_only, out, rtol=1e-3, atol=0)
    with pytest.raises(ValueError, match="runs fp8_block weights only; this weight is int4"):
        QuantExperts(
            quantize_weight(torch.randn(4, 256, 256), "int4"),
            quantize_weight(torch.randn(4, 256, 128), "int4"),
            ExpertGate("stacked", "silu"),
            w8a8=True,
        )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_set_w8a8_reaches_fp8_experts_compiled_and_saved(backend: str, tmp_path) -> None:
    from qlens.modules import QuantExperts

    torch._dynamo.reset()
    model = quantize(make_model("qwen3_moe"), "fp8-block")
    ids = input_ids()
    with torch.no_grad():
        weight_only = model(ids).logits
        modules = [m for m in model.modules() if isinstance(m, QuantLinear | QuantExperts)]
        assert qlens.set_w8a8(model) == len(modules)
        assert any(isinstance(m, QuantExperts) and m.w8a8 for m in modules)
        eager = model(ids).logits
        assert not torch.equal(eager, weight_only)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        # The same torch reference on the same inputs; a token's two routes sum as a + b.
        assert torch.equal(compiled(ids).logits, eager)
    save_quantized(model, tmp_path)
    again = load_quantized(tmp_path)
    assert all(m.w8a8 for m in again.modules() if isinstance(m, QuantLinear | QuantExperts))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, eager)
    torch._dynamo.reset()


def test_set_w8a8_reaches_transformers_fp8_experts_a_bridge_rerouted() -> None:
    from qlens.modules import QuantExperts
    from qlens.modules.expert_gate import ExpertGate
    from qlens.quant.adopt import adopt_module

    model = make_model("mixtral")
    hf_experts = random_fp8_experts(model.config, (128, 128), seed=9)
    model.model.layers[0].mlp.experts = hf_experts
    bridge = qlens.Bridge(model)  # its own forward needs CUDA kernels: rerouted on this CPU
    assert "model.layers.0.mlp.experts" in bridge.rerouted
    ids = input_ids()
    with torch.no_grad():
        weight_only = bridge(ids)
        assert qlens.set_w8a8(bridge) == 1  # the experts: the other linears are float
        w8a8 = bridge(ids)
        assert not torch.equal(w8a8, weight_only)
        # The same as qlens' own experts module over the same payloads, W8A8.
        payloads = adopt_module(hf_experts)
        own = QuantExperts(
            payloads["gate_up_proj"],
            payloads["down_proj"],
            ExpertGate("stacked", "silu"),
            w8a8=True,
        )
        model.model.layers[0].mlp.experts = own
        assert torch.equal(bridge(ids), w8a8)
        model.model.layers[0].mlp.experts = hf_experts
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert torch.equal(compiled(ids).logits, w8a8)
        assert qlens.set_w8a8(bridge, enabled=False) == 1
        assert torch.equal(bridge(ids), weight_only)
    torch._dynamo.reset()
