"""Mixture-of-experts linears in Triton's interpreter against a dequantized reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import count_grouped_launches, rel_err

from benchmarks._samples import random_gguf
from qlens.kernels import dequantize_triton, experts_linear
from qlens.kernels.experts import expert_views, first_expert_view, rows_through_experts
from qlens.kernels.plan import LinearPlan
from qlens.quant.codecs.gguf import GGML_TYPES
from qlens.quant.codecs.intgroup import repack_to_qlens
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

SCHEMES = (
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("int4", {}),
    ("int4", {"group_size": 32, "asymmetric": True}),
)


def _per_expert_global(payload):
    """The same nvfp4 experts with one global scale per expert (as modelopt stores them)."""
    from dataclasses import replace

    experts = payload.shape[0]
    return replace(payload, global_scale=payload.global_scale * torch.linspace(0.5, 2, experts))


@pytest.mark.parametrize("fused", (True, False), ids=("one-launch", "grouped"))
@pytest.mark.parametrize(
    "scheme", SCHEMES, ids=lambda s: s[0] + "".join(f"-{v}" for v in s[1].values())
)
def test_experts_linear_matches_per_token_reference(scheme, fused, monkeypatch):
    import qlens.kernels.experts as experts_module
    import qlens.kernels.gemv as gemv_module

    calls = []
    grouped = count_grouped_launches(monkeypatch)
    monkeypatch.setattr(experts_module, "FUSED_EXPERT_ROWS", 64 if fused else 0)  # 0: grouped
    real = gemv_module.PackedGemv  # prepared once per (payload, dtype) for the one launch
    monkeypatch.setattr(
        gemv_module, "PackedGemv", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    gen = torch.Generator().manual_seed(0)
    name, kwargs = scheme
    payload = quantize_weight(torch.randn(4, 24, 64, generator=gen), name, **kwargs)
    payloads = [payload] + ([_per_expert_global(payload)] if name == "nvfp4" else [])
    ids = torch.tensor([3, 0, 3, 1, 0, 3, 3, 1, 0, 0])  # expert 2 unused
    bias = torch.randn(4, 24, generator=gen)
    for p in payloads:
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
            x = torch.randn(10, 64, generator=gen).to(dtype)
            out = experts_linear(x, p, ids, bias.to(dtype))
            assert out.dtype == dtype
            weights = dequantize(p, torch.float64)  # [experts, out, in]
            ref = (
                torch.einsum("tk,tnk->tn", x.double(), weights[ids]) + bias.to(dtype).double()[ids]
            )
            assert rel_err(out, ref) < tol, (p.global_scale, dtype)
    assert len(calls) == (2 * len(payloads) if fused else 0)
    assert len(grouped) == (0 if fused else 2 * len(payloads))


def test_experts_outside_whole_words_run_one_by_one(monkeypatch):
    import qlens.kernels.gemv as gemv_module

    monkeypatch.setattr(gemv_module, "PackedGemv", None)  # must not be reached
    payload = quantize_weight(torch.randn(3, 16, 90), "int4", group_size=32)  # 45 bytes a row
    x, ids = torch.randn(4, 90), torch.tensor([2, 0, 2, 1])
    ref = torch.einsum("tk,tnk->tn", x.double(), dequantize(payload, torch.float64)[ids])
    assert rel_err(experts_linear(x, payload, ids), ref) < 1e-6


def test_first_expert_view_is_kept_until_the_payload_changes():
    from qlens.kernels.experts import stacked_experts

    payload = quantize_weight(torch.randn(3, 16, 64), "int4", group_size=32)
    ids = torch.tensor([2, 0])
    w, _ = stacked_experts(payload, ids)
    assert stacked_experts(payload, ids)[0] is w
    payload.data = payload.data.clone()  # another tensor: the view is built again, on it
    again, rows = stacked_experts(payload, ids)
    assert again is not w and again.data.data_ptr() == payload.data.data_ptr()
    assert rows.data == again.data.numel() // 4
    odd = quantize_weight(torch.randn(3, 16, 90), "int4", group_size=32)  # 45 bytes a row
    assert stacked_experts(odd, ids) is None and stacked_experts(odd, ids) is None


def test_experts_linear_rejects_bad_expert_ids():
    payload = quantize_weight(torch.randn(2, 8, 32), "int8", group_size=32)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 2\)"):
        experts_linear(torch.randn(3, 32), payload, torch.tensor([0, 2, 1]))


def test_experts_linear_skips_the_host_check_for_ids_in_range(monkeypatch):
    """Callers whose ids are in range by construction skip the host check (a device sync)."""
    payload = quantize_weight(torch.randn(3, 16, 64), "int4", group_size=32)
    x, ids = torch.randn(4, 64), torch.tensor([2, 0, 2, 1])
    expected = experts_linear(x, payload, ids)

    def no_sync(*args, **kwargs):
        raise AssertionError("the ids' range was read on the host")

    monkeypatch.setattr(torch, "aminmax", no_sync)
    assert torch.equal(experts_linear(x, payload, ids, ids_in_range=True), expected)
    with pytest.raises(AssertionError, match="read on the host"):
        experts_linear(x, payload, ids)


def test_dequantize_triton_of_experts_is_bit_exact():
    gen = torch.Generator().manual_seed(2)
    payload = quantize_weight(torch.randn(3, 20, 96, generator=gen), "nvfp4")
    out = dequantize_triton(payload, torch.bfloat16)
    assert out.shape == (3, 20, 96)
    assert torch.equal(out, dequantize(payload, torch.bfloat16))


@pytest.mark.parametrize("type_name", ("Q4_0", "Q5_1", "Q8_0"))
def test_gguf_experts_run_each_expert_through_the_dequantize_route(type_name):
    """An accelerator runs GGUF experts one by one: each expert's view of the ``[experts, out,
    in]`` blocks through the GGUF dequantize kernel, then a matmul (here in the interpreter)."""
    ggml_type = next(t for t in GGML_TYPES.values() if t.name == type_name)
    payload = random_gguf(ggml_type, (3, 16, 64), seed=4)
    assert first_expert_view(payload) is None  # no one-launch path: expert by expert
    weights = dequantize(payload, torch.float32)
    gen = torch.Generator().manual_seed(5)
    x, ids = torch.randn(6, 64, generator=gen), torch.tensor([2, 0, 2, 1, 0, 2])
    for expert, view in enumerate(expert_views(payload)):
        assert view.data.data_ptr() == payload.data[expert].data_ptr()  # a view, no copy
        assert torch.equal(dequantize_triton(view, torch.float32), weights[expert])
        rows = x[ids == expert]
        out = LinearPlan(view, torch.device("cpu"), route="dequantize")(rows)
        assert rel_err(out, rows.double() @ weights[expert].double().T) < 1e-6
    ref = torch.einsum("tk,tnk->tn", x.double(), weights.double()[ids])
    assert rel_err(rows_through_experts(x, payload, ids), ref) < 1e-6
    # The fused experts kernels read no GGUF blocks; Q4_0 / Q8_0 repack exactly for them.
    with pytest.raises(ValueError, match="GGUF Q4_0/Q8_0 map onto them exactly"):
        experts_linear(x, payload, ids)
    if type_name in ("Q4_0", "Q8_0"):
        repacked = repack_to_qlens(payload)
        assert torch.equal(dequantize(repacked, torch.float32), weights)
        assert rel_err(experts_linear(x, repacked, ids), ref) < 1e-6


def test_the_expert_loop_refuses_cuda_graph_capture(monkeypatch):
    """Experts that run one launch per used expert read the routing on the host, which a CUDA
    graph capture cannot: under capture (patched in) they raise, saying why and what to do, as
    does the host check of the ids' range; experts in one launch run as before."""
    import qlens.kernels.experts as experts_module

    monkeypatch.setattr(experts_module, "capturing_cuda_graph", lambda device: True)
    odd = quantize_weight(torch.randn(3, 16, 90), "int4", group_size=32)  # 45 bytes a row
    ids = torch.tensor([2, 0, 2, 1])
    with pytest.raises(
        RuntimeError,
        match=r"int4 experts of shape \[3, 16, 90\] run one launch per used expert \(packed "
        r"4-bit rows of 45 bytes, not whole 32-bit words\).*mode='default'.*fp8-block, int4, int8, "
        r"mxfp4, mxfp8, nvfp4",
    ):
        experts_linear(torch.randn(4, 90), odd, ids, ids_in_range=True)
    fp8 = quantize_weight(torch.randn(3, 16, 128), "fp8-block")
    x = torch.randn(4, 128)
    with pytest.raises(RuntimeError, match=r"fp8_block experts .* per used expert \(W8A8\)"):
        experts_linear(x, fp8, ids, w8a8=True, ids_in_range=True)
    strided = dataclasses.replace(fp8, data=fp8.data.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match=r"\(.*data must be contiguous; call .contiguous\(\)"):
        experts_linear(x, strided, ids, ids_in_range=True)
    blocks = quantize_weight(torch.randn(3, 16, 128), "fp8-block", block_size=(8, 32))
    scales = blocks.scales.transpose(0, 1).contiguous().transpose(0, 1)  # [3, 2, 4], strided
    with pytest.raises(RuntimeError, match=r"\(non-contiguous tensors; call .contiguous\(\)"):
        experts_linear(x, dataclasses.replace(blocks, scales=scales), ids, ids_in_range=True)
    with pytest.raises(RuntimeError, match=r"range on the host.*pass ids_in_range=True"):
        experts_linear(x, fp8, ids)
    ref = torch.einsum("tk,tnk->tn", x.double(), dequantize(fp8, torch.float64)[ids])
    assert rel_err(experts_linear(x, fp8, ids, ids_in_range=True), ref) < 1e-6


def test_experts_on_devices_without_kernels_refuse_cuda_graph_capture(monkeypatch):
    """The reference route of the experts op (no kernels on the device) loops over the experts
    on the host too, so it refuses a capture as well, naming the device's problem."""
    import qlens.kernels.experts as experts_module

    monkeypatch.setattr(experts_module, "capturing_cuda_graph", lambda device: True)
    monkeypatch.delenv("TRITON_INTERPRET")
    payload = quantize_weight(torch.randn(3, 16, 64), "mxfp4")
    with pytest.raises(RuntimeError, match=r"mxfp4 experts .* \(Triton kernels need a CUDA"):
        experts_module.rows_through_experts(torch.randn(2, 64), payload, torch.tensor([1, 2]))
