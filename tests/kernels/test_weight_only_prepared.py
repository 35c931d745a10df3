"""The weight-only kernel's prepared launch (``PreparedWeightOnly``): the launch a plan keeps
for a few rows (``"splitk"``) and for the packed GEMM's rows (``"gemm"``), in Triton's
interpreter, against the unprepared launch it replaces."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import SCHEMES, quantized, scheme_id

import qlens.kernels.plan as plan_module
import qlens.kernels.weight_only as weight_only_module
from qlens.kernels.configs import LinearConfig
from qlens.kernels.weights import kernel_weight

CONFIGS = (
    LinearConfig("splitk", 16, 32, 32, split_k=1),
    LinearConfig("splitk", 16, 32, 32, split_k=2),
    LinearConfig("gemm", 16, 32, 32, split_k=3),
)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.path}-split{c.split_k}")
@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_a_plans_kept_launch_matches_the_unprepared_launch_exactly(case, cfg, monkeypatch):
    """Rows through a plan on the weight-only path: each (input shape, dtype, bias or none)
    prepares one launch, kept for later calls, whose output is bit-identical to
    ``weight_only_linear`` with the same launch (K split or not, bias or none)."""
    monkeypatch.setattr(plan_module, "_weight_config", lambda *args: cfg)
    payload = quantized(40, 96, case)
    plan = plan_module.LinearPlan(payload, torch.device("cpu"), route="kernel")
    view = kernel_weight(payload)
    prepared: list = []
    real_prepare = weight_only_module._WEIGHT_ONLY.prepare
    monkeypatch.setattr(
        weight_only_module._WEIGHT_ONLY,
        "prepare",
        lambda *args, **kwargs: prepared.append(args[0]) or real_prepare(*args, **kwargs),
    )
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 5, 96, generator=gen).to(dtype)
        for b in (bias, None, bias):
            b = None if b is None else b.to(dtype)
            expected = weight_only_module.weight_only_linear(x.reshape(10, 96), view, b, cfg)
            got = plan(x, b)
            assert got.shape == (2, 5, 40)
            assert torch.equal(got, expected.view(2, 5, 40))
    assert len(prepared) == 4  # one per (dtype, bias or none), kept for the repeated call
    assert all(grid == (-(-10 // 16) * -(-40 // 32), cfg.split_k) for grid in prepared)


def test_the_kept_launch_reads_rows_of_a_strided_input():
    """A non-contiguous input of the prepared shape is read as its values, not its storage."""
    cfg = LinearConfig("splitk", 16, 32, 32, split_k=2)
    payload = quantized(40, 96, ("int8", {"group_size": 32}))
    call = weight_only_module.PreparedWeightOnly(
        kernel_weight(payload), 6, torch.float32, False, cfg, (6, 40)
    )
    x = torch.randn(96, 6).t()  # [6, 96], column-major
    expected = weight_only_module.weight_only_linear(
        x.contiguous(), kernel_weight(payload), None, cfg
    )
    assert torch.equal(call(x, None), expected)
