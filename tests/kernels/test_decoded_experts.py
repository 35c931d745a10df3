"""Prefill experts decoded once, then torch's grouped GEMM (``DecodedExperts``), in Triton's
interpreter with the CPU standing in for a Hopper GPU (``torch._grouped_mm`` runs on the CPU
too), against float64 references; and the cases that keep qlens' grouped kernel."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_cases import count_grouped_launches, rel_err

import qlens.kernels.experts as experts_module
from qlens.kernels import experts_linear
from qlens.kernels.decoded_experts import stacked_rows_view
from qlens.kernels.experts import stacked_view
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

SCHEMES = (
    ("int4", {}),
    ("int4", {"group_size": 32, "asymmetric": True}),
    ("mxfp4", {}),
    ("nvfp4", {}),
)
EXPERTS, N, K, ROWS = 4, 128, 128, 80
# Against float64 on the weights decoded to bf16 (what the route multiplies): only the bf16
# output's rounding (2**-9 relative) and the summation order differ. Against the exact
# weights, the decoded weights' own bf16 rounding adds as much again.
DECODED_TOLERANCE, EXACT_TOLERANCE = 4e-3, 8e-3


def _scheme_id(scheme) -> str:
    return scheme[0] + "".join(f"-{v}" for v in scheme[1].values())


@pytest.fixture
def hopper_stand_in(monkeypatch):
    """The CPU takes the route a Hopper GPU takes, from 16 rows an expert (64 rows) on."""
    monkeypatch.setattr(experts_module, "grouped_mm_device", lambda device: True)
    monkeypatch.setattr(experts_module, "DECODED_EXPERTS_MIN_ROWS_PER_EXPERT", 16)


def _reference(x, weights, ids, bias):
    out = torch.einsum("tk,tnk->tn", x.double(), weights.double()[ids])
    return out if bias is None else out + bias.double()[ids]


def _rows(gen: torch.Generator, rows: int = ROWS) -> torch.Tensor:
    """Ids of three of the four experts (expert 2 unused), in random order."""
    return torch.tensor([0, 1, 3])[torch.randint(0, 3, (rows,), generator=gen)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=_scheme_id)
def test_decoded_experts_match_the_reference(scheme, hopper_stand_in, monkeypatch):
    """bf16 prefill rows of packed 4-bit experts: one decode-then-grouped-GEMM call a
    projection, no launch of the grouped kernel, with and without bias."""
    launches = count_grouped_launches(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    payload = quantize_weight(torch.randn(EXPERTS, N, K, generator=gen), scheme[0], **scheme[1])
    decoded = dequantize(payload, torch.bfloat16)
    exact = dequantize(payload, torch.float64)
    ids = _rows(gen)
    x = torch.randn(ROWS, K, generator=gen).to(torch.bfloat16)
    bias = torch.randn(EXPERTS, N, generator=gen).to(torch.bfloat16)
    for b in (bias, None):
        out = experts_linear(x, payload, ids, b, ids_in_range=True)
        assert out.dtype == torch.bfloat16 and out.shape == (ROWS, N)
        assert rel_err(out, _reference(x, decoded, ids, b)) < DECODED_TOLERANCE
        assert rel_err(out, _reference(x, exact, ids, b)) < EXACT_TOLERANCE
    assert launches == ["decoded", "decoded"]


def test_decoded_experts_take_rows_of_one_expert_and_every_expert(hopper_stand_in, monkeypatch):
    """Routings where one expert takes every row, and where each expert takes some."""
    launches = count_grouped_launches(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    payload = quantize_weight(torch.randn(EXPERTS, N, K, generator=gen), "mxfp4")
    decoded = dequantize(payload, torch.bfloat16)
    for ids in (torch.full((70,), 3), torch.randint(0, EXPERTS, (90,), generator=gen)):
        x = torch.randn(ids.numel(), K, generator=gen).to(torch.bfloat16)
        out = experts_linear(x, payload, ids, ids_in_range=True)
        assert rel_err(out, _reference(x, decoded, ids, None)) < DECODED_TOLERANCE
    assert launches == ["decoded", "decoded"]


def _per_expert_global(payload):
    return replace(payload, global_scale=payload.global_scale * torch.linspace(0.5, 2, EXPERTS))


@pytest.mark.parametrize(
    "case",
    [
        "float32 rows",
        "decode rows",
        "global scale per expert",
        "n not a multiple of 8",
        "no Hopper",
        "fp8-block",
        "mxfp8",
        "int8",
    ],
)
def test_other_experts_keep_the_grouped_kernel(case, hopper_stand_in, monkeypatch):
    """float32 rows, rows under the threshold, NVFP4 with a global scale per expert (the rows
    of one weight share one), outputs whose decoded rows would not lie on 16 bytes, GPUs whose
    ``torch._grouped_mm`` loops on the host, and one-byte experts (whose grouped kernel beats
    decoding them): qlens' grouped kernel, still exact."""
    gen = torch.Generator().manual_seed(2)
    n, rows, dtype, scheme = N, ROWS, torch.bfloat16, "int4"
    if case in ("fp8-block", "mxfp8", "int8"):
        scheme = case
    elif case == "float32 rows":
        dtype = torch.float32
    elif case == "decode rows":
        monkeypatch.setattr(experts_module, "DECODED_EXPERTS_MIN_ROWS_PER_EXPERT", 21)  # 84
    elif case == "global scale per expert":
        scheme = "nvfp4"
    elif case == "n not a multiple of 8":
        n = 20
    elif case == "no Hopper":
        monkeypatch.setattr(experts_module, "grouped_mm_device", lambda device: False)
    payload = quantize_weight(torch.randn(EXPERTS, n, K, generator=gen), scheme)
    if case == "global scale per expert":
        payload = _per_expert_global(payload)
    launches = count_grouped_launches(monkeypatch)
    ids = _rows(gen, rows)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    out = experts_linear(x, payload, ids, ids_in_range=True)
    assert len(launches) == 1 and launches[0] != "decoded"
    tolerance = 1e-6 if dtype == torch.float32 else EXACT_TOLERANCE
    assert rel_err(out, _reference(x, dequantize(payload, torch.float64), ids, None)) < tolerance


def test_stacked_rows_view_needs_the_experts_as_consecutive_rows():
    """The rows view spans every expert's rows in order; it is refused for storage holding
    only the first expert, for a global scale per expert, and for blocks of rows crossing
    experts (block FP8 with 200 rows an expert)."""
    gen = torch.Generator().manual_seed(3)
    payload = quantize_weight(torch.randn(EXPERTS, 24, 64, generator=gen), "int4", group_size=32)
    stacked = stacked_view(payload)
    assert stacked is not None
    w, strides = stacked
    rows = stacked_rows_view(w, strides, EXPERTS)
    assert rows is not None and rows.n == EXPERTS * 24
    assert torch.equal(rows.data, payload.data.reshape(EXPERTS * 24, -1))
    assert torch.equal(rows.scales, payload.scales.reshape(EXPERTS * 24, -1))
    assert stacked_rows_view(replace(w, data=w.data.clone()), strides, EXPERTS) is None
    assert stacked_rows_view(w, replace(strides, global_scale=1), EXPERTS) is None
    fp8 = stacked_view(quantize_weight(torch.randn(EXPERTS, 200, 128, generator=gen), "fp8-block"))
    assert fp8 is not None and stacked_rows_view(*fp8, EXPERTS) is None


def test_quant_experts_prefill_through_decoded_experts_matches_the_loop(
    hopper_stand_in, monkeypatch
):
    """A bf16 QuantExperts prefill on the decoded route (one call a projection; a skipped
    route among them) against the same module run expert by expert."""
    from qlens.kernels.experts import ExpertsPlan
    from qlens.modules import ExpertGate, QuantExperts

    gen = torch.Generator().manual_seed(4)
    tokens, top_k = 40, 2
    experts = QuantExperts(
        quantize_weight(torch.randn(EXPERTS, 2 * 64, K, generator=gen), "int4"),
        quantize_weight(torch.randn(EXPERTS, K, 64, generator=gen), "int4"),
        ExpertGate("stacked", "silu"),
    )
    hidden = torch.randn(tokens, K, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    weights, index = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    index[3, 1] = EXPERTS  # a masked route (Mixtral's id == num_experts) is skipped
    weights = weights.to(torch.bfloat16)
    with torch.no_grad():
        loop = experts(hidden, index, weights)
        launches = count_grouped_launches(monkeypatch)
        monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: True)
        decoded = experts(hidden, index, weights)
    assert launches == ["decoded", "decoded"]
    # Both round each projection's output to bf16; the loop multiplies the exact weights.
    assert rel_err(decoded, loop) < 2 * EXACT_TOLERANCE
