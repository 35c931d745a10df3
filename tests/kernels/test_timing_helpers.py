"""The benchmarks' shared launch timer, with graph timing replaced by one plain call (CPU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kernel_cases import quantized

from qlens.kernels import LinearConfig, dequantize_triton, timing


def test_time_launches_times_each_launch_and_marks_failures(monkeypatch, capsys):
    calls: list[int] = []

    def one_call(fns, replays=20):
        for fn in fns:
            fn()
        calls.append(len(fns))
        return 2.5

    monkeypatch.setattr(timing, "time_graph", one_call)
    p = quantized(40, 256, ("int4", {"group_size": 64}))
    x = torch.randn(16, 256)
    exact = F.linear(x.double(), dequantize_triton(p, torch.float32).double())
    good = LinearConfig("gemv", 16, 16, 128)
    narrow = LinearConfig("gemv", 16, 4, 128)  # 16 rows need tensor-core tiles of >= 16 columns
    times, worst = timing.time_launches([p, p], x, [good, narrow], exact)
    assert times[0] == 2.5 and math.isnan(times[1])
    assert calls == [2]  # the failing launch raised before its graph was timed
    assert 0 < worst < 1e-6  # fp32 interpreter products of the exact codes
    assert "failed: block_n must be a power of two >= 16" in capsys.readouterr().out


def test_seeded_weight_repeats_and_reseeds():
    w = timing.seeded_weight(6, 10, "cpu")
    after = torch.randn(3)
    torch.manual_seed(0)
    expected = torch.randn(6, 10, dtype=torch.bfloat16) * 0.02
    assert w.dtype == torch.bfloat16 and torch.equal(w, expected)
    assert torch.equal(after, torch.randn(3))  # draws after it repeat too


def test_time_bf16_linear_times_f_linear_on_every_weight(monkeypatch):
    outs: list[torch.Tensor] = []
    monkeypatch.setattr(timing, "time_graph", lambda fns: outs.extend(f() for f in fns) or 1.5)
    weights = [torch.randn(4, 8), torch.randn(4, 8)]
    x = torch.randn(2, 8)
    assert timing.time_bf16_linear(weights, x) == 1.5
    assert [torch.equal(o, F.linear(x, w)) for o, w in zip(outs, weights, strict=True)] == [
        True,
        True,
    ]
