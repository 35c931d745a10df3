"""Rerouting HF quantized modules whose own forward cannot run on this CPU through qlens."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kernel_route import count_fused_moe_decodes
from tiny_models import input_ids, make_model
from torch import nn
from transformers.integrations.finegrained_fp8 import (
    FP8Experts,
    FP8Linear,
    _dequantize_fp8_weight,
)

from qlens.modules.reroute import reroute_quantized_modules, restore_own_forward

BLOCK = (128, 128)
OWN_FORWARD_ERROR = r"finegrained-fp8 kernel unavailable"


def _fp8_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 60).to(torch.float8_e4m3fn)


def _scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 1e-3 + 1e-4


def _fp8_linear(float_linear: nn.Linear, seed: int) -> FP8Linear:
    """An FP8Linear with random e4m3 weights and scales (ragged shapes allowed)."""
    n, k = float_linear.weight.shape
    layer = FP8Linear(k, n, block_size=BLOCK, has_bias=float_linear.bias is not None)
    with torch.no_grad():
        layer.weight.copy_(_fp8_values((n, k), seed))
        layer.weight_scale_inv.copy_(_scales(tuple(layer.weight_scale_inv.shape), seed + 1))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(n) * 0.1)
    return layer


def _fp8_experts(config: object, seed: int) -> FP8Experts:
    experts = FP8Experts(config, block_size=BLOCK)
    with torch.no_grad():
        for i, name in enumerate(("gate_up_proj", "down_proj")):
            weight = getattr(experts, name)
            weight.copy_(_fp8_values(tuple(weight.shape), seed + 2 * i))
            scale = getattr(experts, f"{name}_scale_inv")
            scale.copy_(_scales(tuple(scale.shape), seed + 2 * i + 1))
    return experts


def _oracle(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    # transformers' own helper, correct for ragged blocks (ceil-div grid)
    return _dequantize_fp8_weight(weight, scale_inv, list(BLOCK), torch.float32)


def test_fp8_linear_runs_through_qlens_and_matches_the_hf_dequantization() -> None:
    float_linear = nn.Linear(256, 200)  # N = 200: a partial last row block
    model = nn.ModuleDict({"proj": _fp8_linear(float_linear, seed=0)})
    layer = model["proj"]
    x = torch.randn(2, 3, 256)
    with pytest.raises(ImportError, match=OWN_FORWARD_ERROR):
        layer(x)
    assert reroute_quantized_modules(model) == ["proj"]
    expected = F.linear(x, _oracle(layer.weight, layer.weight_scale_inv), layer.bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-6)
    # Idempotent, and the module itself (class, tensors, state_dict) is untouched.
    assert reroute_quantized_modules(model) == []
    assert type(layer) is FP8Linear and layer.weight.dtype == torch.float8_e4m3fn
    assert restore_own_forward(model) == ["proj"]
    with pytest.raises(ImportError, match=OWN_FORWARD_ERROR):
        layer(x)


def _fp8_mixtral() -> tuple[nn.Module, nn.Module]:
    """A tiny Mixtral with FP8Linear attention output and FP8Experts, and its float twin."""
    model = make_model("mixtral")
    layer = model.model.layers[0]
    layer.self_attn.o_proj = _fp8_linear(layer.self_attn.o_proj, seed=10)
    layer.mlp.experts = _fp8_experts(model.config, seed=20)
    reference = copy.deepcopy(model)
    ref_layer = reference.model.layers[0]
    o_proj = layer.self_attn.o_proj
    float_o = nn.Linear(o_proj.in_features, o_proj.out_features, bias=o_proj.bias is not None)
    with torch.no_grad():
        float_o.weight.copy_(_oracle(o_proj.weight, o_proj.weight_scale_inv))
    ref_layer.self_attn.o_proj = float_o
    float_experts = type(make_model("mixtral").model.layers[0].mlp.experts)(model.config)
    experts = layer.mlp.experts
    with torch.no_grad():
        float_experts.gate_up_proj.copy_(
            _oracle(experts.gate_up_proj, experts.gate_up_proj_scale_inv)
        )
        float_experts.down_proj.copy_(_oracle(experts.down_proj, experts.down_proj_scale_inv))
    ref_layer.mlp.experts = float_experts
    return model, reference


def test_fp8_model_runs_through_qlens_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    model, reference = _fp8_mixtral()
    ids = input_ids()
    with pytest.raises(ImportError, match=OWN_FORWARD_ERROR), torch.no_grad():
        model(ids)
    with caplog.at_level(logging.INFO, logger="qlens.modules.reroute"):
        rerouted = reroute_quantized_modules(model)
    assert rerouted == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.experts"]
    assert "qlens rerouted 2 quantized modules" in caplog.text
    assert "rerouted model.layers.0.mlp.experts (FP8Experts) through qlens" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=2e-5, rtol=1e-5)
        # A deep copy keeps qlens' forward, bound to the copy.
        torch.testing.assert_close(
            copy.deepcopy(model)(ids).logits, reference(ids).logits, atol=2e-5, rtol=1e-5
        )


def test_keep_patterns_leave_the_own_forward() -> None:
    model, _ = _fp8_mixtral()
    assert reroute_quantized_modules(model, keep=["*.experts"]) == [
        "model.layers.0.self_attn.o_proj"
    ]
    with pytest.raises(ImportError, match=OWN_FORWARD_ERROR), torch.no_grad():
        model(input_ids())


class _StridedLayout:
    """Stand-in for a triton_kernels layout whose storage is not swizzled."""

    def unswizzle_data(self, data: torch.Tensor) -> torch.Tensor:
        return data


class _TritonTensor:
    """What Mxfp4GptOssExperts holds on a GPU: a wrapper with ``.storage.data/.layout``."""

    def __init__(self, data: torch.Tensor) -> None:
        self.storage = SimpleNamespace(data=data, layout=_StridedLayout())


def _mxfp4_gpt_oss() -> tuple[nn.Module, nn.Module]:
    """A tiny GPT-OSS whose MLP is transformers' Mxfp4GptOssMLP/Experts holding random MXFP4
    blocks as the GPU loader leaves them, and its float twin dequantized by transformers."""
    from transformers.integrations.mxfp4 import (
        Mxfp4GptOssExperts,
        Mxfp4GptOssMLP,
        convert_moe_packed_tensors,
    )

    model = make_model("gpt_oss")
    reference = copy.deepcopy(model)
    mlp = model.model.layers[0].mlp
    experts = Mxfp4GptOssExperts(model.config)
    g = torch.Generator().manual_seed(5)
    for proj, (n_out, k) in {"gate_up_proj": (256, 128), "down_proj": (128, 128)}.items():
        blocks = torch.randint(0, 256, (4, n_out, k // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 125, (4, n_out, k // 32), dtype=torch.uint8, generator=g)
        bias = getattr(mlp.experts, f"{proj}_bias").detach()
        getattr(experts, f"{proj}_bias").data.copy_(bias)
        # As transformers' swizzle_mxfp4_convertops stores them: data/scales transposed.
        del experts._parameters[proj]
        setattr(experts, proj, _TritonTensor(blocks.reshape(4, n_out, -1).transpose(-2, -1)))
        config = SimpleNamespace(weight_scale=_TritonTensor(scales.transpose(-2, -1)))
        setattr(experts, f"{proj}_precision_config", config)
        with torch.no_grad():  # transformers' own dequantization, [E, in, out] like GptOssExperts
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            getattr(reference.model.layers[0].mlp.experts, proj).copy_(dense)
    model.model.layers[0].mlp = Mxfp4GptOssMLP(mlp.router, experts)
    return model, reference


def test_gpt_oss_mxfp4_experts_run_through_qlens() -> None:
    model, reference = _mxfp4_gpt_oss()
    ids = input_ids()
    with pytest.raises(NameError, match="triton_kernels_hub"), torch.no_grad():
        model(ids)
    rerouted = reroute_quantized_modules(model)
    assert rerouted == ["model.layers.0.mlp.experts", "model.layers.0.mlp"]
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", (False, True), ids=("unfused", "fused"))
@pytest.mark.parametrize("checkpoint", ["gpt_oss mxfp4", "mixtral fp8"])
def test_rerouted_experts_in_one_launch_match_without_a_host_check(
    checkpoint: str, fused: bool, monkeypatch
) -> None:
    """The one-launch experts paths of a rerouted module (forced here: the interpreter runs the
    kernels on CPU tensors) match the reference and read no expert ids on the host:
    transformers' Mxfp4GptOssExperts through the word-wise GEMV, its FP8Experts (block FP8)
    through the grouped GEMM; on an accelerator (``fused``) both through the fused MoE decode,
    GPT-OSS' clamped SwiGLU and FP8Experts' own gate (checked to be ``silu(gate) * up``)."""
    from qlens.kernels.experts import ExpertsPlan

    model, reference = _mxfp4_gpt_oss() if checkpoint == "gpt_oss mxfp4" else _fp8_mixtral()
    reroute_quantized_modules(model)
    ids = input_ids()[:, :4]  # 4 tokens x top-k routes: few rows, one launch per projection
    monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: True)
    calls = count_fused_moe_decodes(monkeypatch, accelerate=True) if fused else []
    monkeypatch.setattr(torch, "aminmax", None)  # the ids' host check must not run
    monkeypatch.setattr("qlens.kernels.experts.quantized_linear", None)  # nor an expert loop
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert len(calls) == (1 if fused else 0)  # the one MoE layer, fused or not


def _hadamard(size: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_higgs_linear_runs_through_qlens_without_a_workspace() -> None:
    from transformers.integrations.higgs import HiggsLinear

    from qlens.quant.codecs.higgs import pack_flute, tables2_from_grid

    n, k, group, had = 256, 128, 32, 64
    layer = HiggsLinear(k, n, num_bits=4, dtype=torch.bfloat16, group_size=group, hadamard_size=had)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (k, n), generator=g)  # FLUTE's [K, N] per-element codes
    grid = torch.randn(256, 2, generator=g).to(torch.bfloat16)
    scales = (torch.rand(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    with torch.no_grad():
        # template 20 of the 4-bit FLUTE table packs with TileP 32
        layer.weight.copy_(pack_flute(codes, 4, 32))
        layer.scales.copy_(scales)
        layer.bias.copy_(torch.randn(n, generator=g).to(torch.bfloat16))
    # transformers stores the bf16 grid's bits labelled float16
    layer.tables2 = nn.Parameter(
        tables2_from_grid(grid, 4).view(torch.float16), requires_grad=False
    )
    layer.tune_metadata = SimpleNamespace(template_id=20)
    x = torch.randn(3, k, generator=g)
    with pytest.raises(Exception, match="Workspace must be set before calling forward"):
        layer(x)
    model = nn.ModuleDict({"proj": layer})
    assert reroute_quantized_modules(model) == ["proj"]
    # Independent reconstruction: pair lookup, group scales, 64-point Hadamard / sqrt(64).
    pairs = grid.float().reshape(16, 16, 2)[codes[0::2], codes[1::2]]  # [K/2, N, 2]
    rotated = pairs.permute(1, 0, 2).reshape(n, k) * scales.float().repeat_interleave(group, 1)
    weight = (rotated.reshape(n, k // had, had) @ _hadamard(had)).reshape(n, k) / 8
    expected = F.linear(x, weight, layer.bias.float())
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_rerouted_model_keeps_every_hook_of_its_float_twin() -> None:
    from qlens.bridge import Bridge

    model, reference = _fp8_mixtral()
    reroute_quantized_modules(model)
    bridge, float_bridge = Bridge(model), Bridge(reference)
    assert bridge.hook_names == float_bridge.hook_names
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(input_ids())
        expected, float_cache = float_bridge.run_with_cache(input_ids())
    assert set(cache.keys()) == set(float_cache.keys())
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)


def test_runnable_quantized_modules_are_left_alone_unless_forced() -> None:
    import bitsandbytes as bnb

    float_linear = nn.Linear(128, 64)
    layer = bnb.nn.Linear4bit(128, 64, compute_dtype=torch.float32, quant_type="nf4")
    layer.load_state_dict(float_linear.state_dict())
    model = nn.ModuleDict({"proj": layer.to("cpu")})  # quantizes the weight
    assert reroute_quantized_modules(model) == []  # bitsandbytes runs on the CPU itself
    assert reroute_quantized_modules(model, force=True) == ["proj"]
    x = torch.randn(3, 128)
    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    torch.testing.assert_close(layer(x), F.linear(x, weight.float(), layer.bias))


def test_an_own_gate_is_fused_only_when_it_computes_silu_times_up() -> None:
    from qlens.modules.reroute import _computes_silu_gate

    def gate(act, clamp=None):
        def apply(gate_up: torch.Tensor) -> torch.Tensor:
            g, up = gate_up.chunk(2, dim=-1)
            if clamp is not None:
                g, up = g.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
            return act(g) * up

        return apply

    assert _computes_silu_gate(gate(torch.nn.functional.silu))
    assert not _computes_silu_gate(gate(torch.nn.functional.silu, clamp=7.0))  # a swiglu limit
    assert not _computes_silu_gate(gate(torch.nn.functional.gelu))
    assert not _computes_silu_gate(gate(lambda g: torch.tanh(g / 30) * 30 * torch.sigmoid(g)))


def test_rerouted_module_reads_edits_in_place_and_replaced_state(monkeypatch) -> None:
    """A call checks the module's tensors and states by identity and version counter only: an
    edit in place or a replaced quantization state is read again at the next call, nothing
    else re-adopts."""
    bnb = pytest.importorskip("bitsandbytes")
    import qlens.quant.adopt as adopt

    adoptions: list[str] = []
    adopt_module = adopt.adopt_module
    monkeypatch.setattr(
        adopt, "adopt_module", lambda module: adoptions.append("x") or adopt_module(module)
    )
    layer = bnb.nn.Linear4bit(128, 64, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(
        torch.randn(64, 128) * 0.02, requires_grad=False, quant_type="nf4", module=layer
    ).to("cpu")  # quantizes
    layer.bias = nn.Parameter(torch.zeros(64), requires_grad=False)
    layer.quant_state = SimpleNamespace()  # a module attribute read as state
    holder = nn.Sequential(layer)
    assert reroute_quantized_modules(holder, force=True) == ["0"]
    x = torch.randn(2, 128)
    first = holder(x)
    for _ in range(3):
        assert torch.equal(holder(x), first)
    assert len(adoptions) == 1
    with torch.no_grad():
        layer.bias.add_(1.0)  # the module's own tensor: seen through its version counter
    assert torch.equal(holder(x), first + 1) and len(adoptions) == 2
    layer.quant_state = SimpleNamespace()  # a replaced state is read again
    holder(x)
    assert len(adoptions) == 3


def test_bitsandbytes_model_rerouted_after_wrapping_keeps_its_hooks() -> None:
    """A bridge over a bitsandbytes NF4 model (transformers' loader's modules) keeps their own
    forward; rerouting afterwards (``force=True``) moves them onto qlens' forward under the same
    hook points, with the same logits up to the matmul's rounding."""
    pytest.importorskip("bitsandbytes")
    import qlens
    from benchmarks._e2e_models import bnb_quantized

    model = bnb_quantized(make_model("llama"), "bnb-nf4")
    for module in model.modules():
        if hasattr(module, "compute_dtype"):
            module.compute_dtype = torch.float32
    bridge = qlens.load(model)
    assert bridge.rerouted == []
    ids = input_ids()
    names = "blocks.1.hook_resid_post"
    own, own_cache = bridge.run_with_cache(ids, names_filter=names)
    paths = reroute_quantized_modules(bridge.model, force=True)
    assert len(paths) == 14 and paths[0] == "model.layers.0.self_attn.q_proj"
    ours, cache = bridge.run_with_cache(ids, names_filter=names)
    # Both multiply the exact float32 weights in float32, unless bitsandbytes' own CPU kernel
    # (AVX512-BF16 machines) rounds to bf16 (2**-9 relative).
    assert ((ours - own).norm() / own.norm()).item() < 1e-2
    assert ((cache[names] - own_cache[names]).norm() / own_cache[names].norm()).item() < 1e-2
    restore_own_forward(bridge.model)
    assert torch.equal(bridge(ids), own)
