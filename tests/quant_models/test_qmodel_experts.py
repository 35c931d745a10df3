"""QuantExperts against transformers' own experts modules running on the dequantized weights."""

from __future__ import annotations

import copy

import pytest
import torch
from grouped_launches import grouped_launch_grids
from tiny_models import input_ids, make_model

from qlens.modules import ExpertGate, QuantExperts
from qlens.modules.model_quantize import quantize
from qlens.quant.dequantize import dequantize
from qlens.quant.expert_payloads import select_expert
from qlens.quant.quantize import quantize_weight


def _routing(tokens: int, experts: int, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return index, weights


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_matches_the_hf_experts_on_dequantized_weights(family: str) -> None:
    model = make_model(family)
    experts_path = "model.layers.0.mlp.experts"
    quantized = quantize(model, "nvfp4").get_submodule(experts_path)
    assert isinstance(quantized, QuantExperts)
    hf = copy.deepcopy(model.get_submodule(experts_path))
    gate_up, down = dequantize(quantized.gate_up_payload), dequantize(quantized.down_payload)
    with torch.no_grad():
        if family == "gpt_oss":  # HF holds [E, in, out]
            gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
        hf.gate_up_proj.copy_(gate_up)
        hf.down_proj.copy_(down)
    hf.config._experts_implementation = "eager"
    x = torch.randn(9, 128)
    index, weights = _routing(9, 4)
    if family == "mixtral":
        index[0, 1] = 4  # Mixtral's masked route (id == num_experts) is skipped
    with torch.no_grad():
        expected = hf(x, index, weights)
        got = quantized(x, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    if family == "gpt_oss":
        with torch.no_grad():
            by_keyword = quantized(x, router_indices=index, routing_weights=weights)
        assert torch.equal(by_keyword, got)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("scheme", ["int4", "mxfp4", "nvfp4"])
def test_one_launch_routing_matches_the_expert_loop(family: str, scheme: str, monkeypatch) -> None:
    """Few (token, route) rows on an accelerator take one experts-GEMV launch per projection
    (faked here: the interpreter runs the kernels on CPU tensors); same result as the loop, and
    no host-side check of the (clamped) expert ids."""
    from qlens.kernels.experts import ExpertsPlan

    model = make_model(family)
    quantized = quantize(model, scheme).get_submodule("model.layers.0.mlp.experts")
    x = torch.randn(5, 128)
    index, weights = _routing(5, 4)
    index[1, 0] = 4  # a skipped route
    with torch.no_grad():
        loop = quantized(x, index, weights)
        monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: True)
        monkeypatch.setattr(torch, "aminmax", None)  # the ids' host check must not run
        fused = quantized(x, index, weights)
    torch.testing.assert_close(fused, loop, atol=1e-4, rtol=1e-4)


def test_one_launch_routing_needs_an_accelerator_and_rows() -> None:
    from qlens.kernels.experts import FUSED_EXPERT_ROWS, ExpertsPlan, experts_in_one_launch

    payload = quantize_weight(torch.randn(3, 32, 64), "nvfp4")
    assert not experts_in_one_launch((payload,), torch.randn(2, 64), 2)  # CPU: reference path
    assert not ExpertsPlan(payload, torch.device("cpu")).one_launch(2)
    meta = torch.empty(2, 64, device="meta")
    assert not experts_in_one_launch((payload,), meta, FUSED_EXPERT_ROWS + 1)  # no kernels
    assert not experts_in_one_launch((payload,), meta, 0)


def test_prefill_in_one_launch_needs_whole_words_or_bytes(monkeypatch) -> None:
    """Beyond FUSED_EXPERT_ROWS rows packed 4-bit experts in whole words and one-byte experts
    (fp8-block, MXFP8, int8) run all at once (the grouped GEMM); packed rows that are not
    whole words keep the expert loop."""
    monkeypatch.setattr("qlens.kernels.experts.kernel_device_problem", lambda device: None)
    from qlens.kernels.experts import FUSED_EXPERT_ROWS, ExpertsPlan, experts_in_one_launch

    meta = torch.empty(2, 64, device="meta")
    packed = quantize_weight(torch.randn(3, 32, 64), "nvfp4")
    fp8 = quantize_weight(torch.randn(3, 32, 64), "fp8-block", block_size=(16, 32))
    mxfp8 = quantize_weight(torch.randn(3, 32, 64), "mxfp8")
    int8 = quantize_weight(torch.randn(3, 32, 70), "int8", group_size=32)
    odd = quantize_weight(torch.randn(3, 16, 90), "int4", group_size=32)  # 45 bytes a row
    assert experts_in_one_launch((packed, fp8, mxfp8, int8), meta, FUSED_EXPERT_ROWS + 1)
    assert experts_in_one_launch((packed, fp8, odd), meta, FUSED_EXPERT_ROWS)
    assert not experts_in_one_launch((fp8, odd), meta, FUSED_EXPERT_ROWS + 1)
    for payload in (fp8, mxfp8, int8):
        plan = ExpertsPlan(payload, meta.device)
        assert plan.one_launch(1) and plan.one_launch(FUSED_EXPERT_ROWS + 1)
        assert plan.stacked is not None and not plan.stacked[0].packed  # grouped at any count


def test_one_launch_routing_needs_formats_the_kernels_read(monkeypatch) -> None:
    import dataclasses

    monkeypatch.setattr("qlens.kernels.experts.kernel_device_problem", lambda device: None)
    from qlens.kernels.experts import FUSED_EXPERT_ROWS, ExpertsPlan, experts_in_one_launch

    payload = quantize_weight(torch.randn(3, 32, 64), "nvfp4")
    meta = torch.empty(2, 64, device="meta")
    assert experts_in_one_launch((payload,), meta, 2)
    foreign = dataclasses.replace(payload, layout={"packing": "gptq"})  # not the qlens packing
    assert not experts_in_one_launch((payload, foreign), meta, 2)
    plan = ExpertsPlan(payload, meta.device)  # what the modules ask, once per payload
    assert plan.one_launch(2) and plan.one_launch(FUSED_EXPERT_ROWS)
    assert plan.one_launch(FUSED_EXPERT_ROWS + 1)  # prefill: the grouped GEMM
    assert not plan.one_launch(0)
    assert not ExpertsPlan(foreign, meta.device).one_launch(2)
    odd = quantize_weight(torch.randn(3, 16, 90), "int4", group_size=32)  # 45 bytes a row
    odd_plan = ExpertsPlan(odd, meta.device)  # the GEMV reads it byte-wise, the grouped GEMM not
    assert odd_plan.one_launch(FUSED_EXPERT_ROWS) == experts_in_one_launch((odd,), meta, 2)
    assert not odd_plan.one_launch(FUSED_EXPERT_ROWS + 1)


def test_select_expert_views_one_expert() -> None:
    weight = torch.randn(3, 32, 64)
    payload = quantize_weight(weight, "nvfp4")
    assert payload.global_scale.ndim == 0
    second = select_expert(payload, 1)
    assert second.shape == (32, 64)
    assert second.global_scale is payload.global_scale
    assert torch.equal(dequantize(second), dequantize(payload)[1])
    with pytest.raises(IndexError, match="expert 3 out of range for a payload of 3 experts"):
        select_expert(payload, 3)
    with pytest.raises(ValueError, match=r"expected a fused experts payload.*\[32, 64\]"):
        select_expert(second, 0)


def test_bad_construction_and_calls_raise() -> None:
    gate_up = quantize_weight(torch.randn(2, 64, 32), "int8")
    gate = ExpertGate("stacked", "silu")
    with pytest.raises(ValueError, match=r"down payload has shape \[2, 32, 16\].*\[2, 32, 32\]"):
        QuantExperts(gate_up, quantize_weight(torch.randn(2, 32, 16), "int8"), gate)
    experts = QuantExperts(gate_up, quantize_weight(torch.randn(2, 32, 32), "int8"), gate)
    with pytest.raises(TypeError, match="QuantExperts needs the routing"):
        experts(torch.randn(3, 32))
    with pytest.raises(ValueError, match="gate layout must be one of"):
        ExpertGate("fused", "silu")
    with pytest.raises(ValueError, match="clamped_swiglu gate needs both alpha and limit"):
        ExpertGate("interleaved", "clamped_swiglu", alpha=1.0)


def test_routing_of_other_shapes_is_refused_with_the_shapes() -> None:
    """The check every experts forward (eager, fused or traced) runs once as it enters."""
    from qlens.modules.routing import check_routing

    index, weights = _routing(3, 2, k=2)
    shapes = r"routing shapes disagree: hidden_states \[3, 32\], top_k_index \[3, 2\]"
    with pytest.raises(ValueError, match=shapes + r", top_k_weights \[3, 1\]"):
        check_routing(torch.randn(3, 32), index, weights[:, :1])
    with pytest.raises(ValueError, match=r"hidden_states \[1, 3, 32\]"):  # batch not flattened
        check_routing(torch.randn(1, 3, 32), index, weights)
    with pytest.raises(ValueError, match=r"hidden_states \[4, 32\]"):
        check_routing(torch.randn(4, 32), index, weights)
    check_routing(torch.randn(3, 32), index, weights)


def test_payloads_are_exposed_and_float_weights_are_not() -> None:
    gate_up = quantize_weight(torch.randn(2, 64, 32), "mxfp8")
    down = quantize_weight(torch.randn(2, 32, 32), "mxfp8")
    experts = QuantExperts(gate_up, down, ExpertGate("stacked", "silu"))
    weights = dequantize(experts)
    assert set(weights) == {"gate_up_proj", "down_proj"}
    assert torch.equal(weights["gate_up_proj"], dequantize(gate_up))
    assert torch.equal(weights["down_proj"], dequantize(down))
    with pytest.raises(AttributeError, match=r"not a float gate_up_proj.*qlens\.dequantize"):
        _ = experts.gate_up_proj
    assert "format=mxfp8" in repr(experts) and "gate=stacked/silu" in repr(experts)


@pytest.mark.parametrize(
    ("scheme", "seq"),
    [
        ("int4", 20),
        ("mxfp4", 20),
        ("nvfp4", 20),
        ("fp8-block", 20),
        ("fp8-block", 1),
        ("mxfp8", 20),
        ("int8", 1),
    ],
)
def test_moe_forwards_route_through_grouped_launches(scheme: str, seq: int, monkeypatch) -> None:
    """A forward of a quantized Qwen3-MoE runs each experts projection in one grouped launch
    (forced here: the interpreter runs the kernels on CPU tensors), no expert loop and no host
    check of the ids: at prefill rows beyond FUSED_EXPERT_ROWS for every scheme, and at a
    decode step's few rows for one-byte experts; its logits match the reference route (each
    expert dequantized and multiplied by torch) to float32 rounding."""
    import qlens.kernels.experts as experts_module
    from qlens.kernels.experts import FUSED_EXPERT_ROWS

    model = quantize(make_model("qwen3_moe"), scheme)
    ids = input_ids(seq=seq, batch=2)  # 2 * seq tokens x top-2
    with torch.no_grad():
        expected = model(ids).logits
    rows: list[int] = []
    launches = grouped_launch_grids(monkeypatch)
    monkeypatch.setattr(
        experts_module.ExpertsPlan, "one_launch", lambda plan, n: rows.append(n) or True
    )
    monkeypatch.setattr(torch, "aminmax", None)  # the ids' host check must not run
    monkeypatch.setattr(experts_module, "quantized_linear", None)  # nor an expert loop
    with torch.no_grad():
        got = model(ids).logits
    assert rows == [4 * seq, 4 * seq]  # asked of gate_up's and down's plans
    assert (rows[0] > FUSED_EXPERT_ROWS) == (seq == 20)
    assert len(launches) == 2  # gate_up and down of the one MoE layer
    # Both routes decode the same weights exactly; only float32 summation orders differ
    # (logits near 1: differences near 1e-7).
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_the_module_expert_loop_refuses_cuda_graph_capture(monkeypatch) -> None:
    """Experts without a one-launch path (here: the CPU) loop over the hit experts, reading the
    routing on the host: under CUDA graph capture (patched in) the forward raises, naming the
    remedies, instead of torch's copy error."""
    model = quantize(make_model("qwen3_moe"), "fp8-block")
    ids = input_ids(seq=3, batch=1)
    monkeypatch.setattr("qlens.modules.routing.capturing_cuda_graph", lambda device: True)
    with (
        pytest.raises(RuntimeError, match=r"one expert at a time.*mode='default'.*fp8-block"),
        torch.no_grad(),
    ):
        model(ids)
