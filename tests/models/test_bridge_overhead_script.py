"""benchmarks/bridge_overhead.py keeps working against the current Bridge (tiny model, 1 run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bridge_overhead.py"
TINY_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def _script():
    name = "qlens_benchmark_bridge_overhead"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_every_variant_runs_and_the_table_has_ratios():
    bench = _script()
    args = bench.parse_args(["--tokens", "8", "--repeats", "1", "--warmup", "0"])
    plain, bridged = bench.random_pair(TINY_SHAPE, "cpu")
    assert plain.dtype == bridged.dtype == torch.bfloat16
    assert torch.equal(plain.lm_head.weight, bridged.lm_head.weight)
    timings = bench.measure("qlens", "tiny", plain, bridged, None, args, "cpu")
    assert [t.variant for t in timings] == [
        "plain HF",
        "no hooks",
        "cache residual stream",
        "cache everything",
    ]
    assert all(t.wall_s > 0 and len(t.cpu_runs) == 1 for t in timings)
    table = bench.render(timings, args, ["a note"])
    assert "| qlens | tiny | 8 | plain HF |" in table
    assert "| 1.000× |" in table
    assert "- a note" in table


def test_residual_filter_selects_exactly_the_residual_stream():
    bench = _script()
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid", "blocks.3.hook_resid_post"]
    assert all(bench.is_residual_hook(name) for name in names)
    assert not any(
        bench.is_residual_hook(name)
        for name in ["hook_embed", "blocks.0.attn.hook_z", "blocks.0.hook_attn_out"]
    )
