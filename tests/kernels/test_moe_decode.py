"""The fused MoE decode (two launches a block) in Triton's interpreter: against a float64
reference of the routed experts, and against the unfused launches it replaces."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import rel_err

from qlens.kernels.experts import ExpertsPlan
from qlens.kernels.gate_rule import GateRule
from qlens.kernels.runtime import interpreting
from qlens.modules.dispatch import fused_experts_forward
from qlens.modules.expert_gate import ExpertGate
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="runs the kernels on CPU tensors (TRITON_INTERPRET=1)"
)

EXPERTS, HIDDEN, INNER = 4, 64, 48
SCHEMES = (
    ("int4", {}),
    ("int4", {"group_size": 32, "asymmetric": True}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("fp8-block", {}),
    ("int8", {"group_size": 32}),
)
GATES = (
    ExpertGate("stacked", "silu"),  # Qwen3-MoE, Mixtral
    ExpertGate("interleaved", "clamped_swiglu", alpha=1.702, limit=7.0),  # GPT-OSS
)
# Token 0 routes to three experts; token 1 has a skipped route on each side of the range.
IDS = torch.tensor([[0, 3, 1], [2, EXPERTS, -1]])


def _plans(scheme: tuple[str, dict], seed: int = 0) -> tuple[ExpertsPlan, ExpertsPlan]:
    """Plans of random gate|up and down experts, taken as an accelerator's (the CPU's plans
    run the expert loop otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    name, options = scheme
    first = quantize_weight(torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=gen), name, **options)
    down = quantize_weight(torch.randn(EXPERTS, HIDDEN, INNER, generator=gen), name, **options)
    plans = ExpertsPlan(first, torch.device("cpu")), ExpertsPlan(down, torch.device("cpu"))
    for plan in plans:
        plan._accelerated = True
    return plans


def _reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    first: QuantPayload,
    down: QuantPayload,
    biases: tuple[torch.Tensor, torch.Tensor],
    gate: ExpertGate,
) -> torch.Tensor:
    """The routed experts in float64, route by route (skipped routes left out)."""
    w1, w2 = dequantize(first, torch.float64), dequantize(down, torch.float64)
    b1, b2 = (b.double() for b in biases)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < EXPERTS:
                h = gate.apply(w1[e] @ x[t].double() + b1[e])
                out[t] += float(weights[t, j]) * (w2[e] @ h + b2[e])
    return out


def _call(plans, gate, x, weights, biases, rule):
    first, down = plans
    return fused_experts_forward(
        x, IDS, weights, first, down, *biases, gate.apply, None, rule
    )  # fmt: skip


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.activation)
@pytest.mark.parametrize(
    "scheme", SCHEMES, ids=lambda s: s[0] + "".join(f"-{v}" for v in s[1].values())
)
def test_fused_decode_matches_the_reference_and_the_unfused_launches(scheme, gate):
    plans = _plans(scheme)
    gen = torch.Generator().manual_seed(1)
    weights = torch.rand(2, 3, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, HIDDEN, generator=gen).to(dtype)
        biases = (
            torch.randn(EXPERTS, 2 * INNER, generator=gen).to(dtype),
            torch.randn(EXPERTS, HIDDEN, generator=gen).to(dtype),
        )
        fused = _call(plans, gate, x, weights, biases, gate.kernel_rule)
        assert len(plans[0]._fused) == 1 + (dtype == torch.bfloat16)  # prepared, kept
        unfused = _call(plans, gate, x, weights, biases, None)
        assert fused.dtype == dtype and fused.shape == x.shape
        ref = _reference(x, IDS, weights, plans[0].payload, plans[1].payload, biases, gate)
        if dtype == torch.float32:
            assert rel_err(fused, ref) < 1e-5
            # the same products, summed over the routes in another order
            torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6 * ref.abs().max())
        else:
            # every rounding of the unfused path kept: the same bf16 values
            assert rel_err(fused, ref) < 2e-2
            torch.testing.assert_close(fused, unfused, rtol=2**-8, atol=0)


def test_fused_decode_without_biases_and_with_many_tokens():
    plans = _plans(("mxfp4", {}), seed=3)
    gate = GATES[0]
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, EXPERTS, (16, 4), generator=gen)  # 64 routed rows: the most fused
    weights = torch.rand(16, 4, generator=gen)
    x = torch.randn(16, HIDDEN, generator=gen)
    first, down = plans
    fused = fused_experts_forward(x, ids, weights, first, down, None, None, gate.apply, None,
                                  gate.kernel_rule)  # fmt: skip
    zero = (torch.zeros(EXPERTS, 2 * INNER), torch.zeros(EXPERTS, HIDDEN))
    ref = _reference(x, ids, weights, first.payload, down.payload, zero, gate)
    assert rel_err(fused, ref) < 1e-5
    assert list(first._fused.values())[0] is not None


def test_more_rows_or_wider_floats_are_not_fused():
    first, down = _plans(("int4", {}))
    rule = GATES[0].kernel_rule
    assert first.fused_decode(down, rule, 16, 4, torch.float32, (False, False)) is not None
    assert first.fused_decode(down, rule, 17, 4, torch.float32, (False, False)) is None
    assert first.fused_decode(down, rule, 1, 4, torch.float64, (False, False)) is None


def test_a_new_down_plan_drops_the_fused_launches_of_the_old_one():
    first, down = _plans(("int4", {}))
    rule = GATES[0].kernel_rule
    kept = first.fused_decode(down, rule, 1, 2, torch.float32, (False, False))
    assert first.fused_decode(down, rule, 1, 2, torch.float32, (False, False)) is kept
    _, other = _plans(("int4", {}), seed=5)
    fresh = first.fused_decode(other, rule, 1, 2, torch.float32, (False, False))
    assert fresh is not None and fresh is not kept and len(first._fused) == 1


def test_gates_without_a_fused_form_have_no_rule():
    assert ExpertGate("stacked", "gelu").kernel_rule is None
    assert ExpertGate("stacked", "silu").kernel_rule == GateRule(False, "silu")
    with pytest.raises(ValueError, match="no fused kernel for the activation 'gelu'"):
        GateRule(False, "gelu")


def test_projections_of_other_blocks_are_refused():
    from qlens.kernels.moe_decode import FusedMoeDecode

    first, _ = _plans(("int4", {}))
    _, other = _plans(("int4", {}), seed=1)
    wide = quantize_weight(torch.randn(EXPERTS, HIDDEN, 2 * INNER), "int4")  # down of 2 * INNER
    wide_plan = ExpertsPlan(wide, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"gate_up experts \[96, 64\] do not match down experts"):
        FusedMoeDecode(
            first._fused_side(), wide_plan._fused_side(), EXPERTS, GATES[0].kernel_rule, 1, 2,
            torch.float32, (False, False),
        )  # fmt: skip
    assert FusedMoeDecode(
        first._fused_side(), other._fused_side(), EXPERTS, GATES[0].kernel_rule, 1, 2,
        torch.float32, (False, False),
    ).inner == INNER  # fmt: skip
