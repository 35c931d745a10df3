"""Is eager decode host-bound? Host enqueue time against wall time of one-token forwards.

Builds a random-weight Llama (``--size``), bf16 and each of ``--schemes`` (``qlens.quantize``),
prefills a 32-token prompt into a ``DynamicCache``, then times ``--steps`` one-token forwards:
host time is ``perf_counter`` around the forward call with no sync, wall time is until a sync
after it returns. Also the median host time of one linear call inside the model (each
``nn.Linear`` / ``QuantLinear`` forward wrapped in a ``perf_counter`` pair) and, for the
quantized models, the inclusive median of each step of the quantized call (its functions
wrapped the same way). bf16 runs first and last, to show drift.

Run on a GPU: ``python benchmarks/decode_host.py --size 1b --schemes int4,fp8-block``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _e2e_models import build_model, shapes
from torch import nn

import qlens
from qlens.modules import QuantLinear

STEPS = {
    "QuantLinear.forward": ("qlens.modules.linear", "QuantLinear", "forward"),
    "PayloadModule.linear_plan": ("qlens.modules.payload_buffers", "PayloadModule", "linear_plan"),
    "LinearPlan.__call__": ("qlens.kernels.plan", "LinearPlan", "__call__"),
    "PackedGemv.__call__": ("qlens.kernels.gemv", "PackedGemv", "__call__"),
    "ByteGemv.__call__": ("qlens.kernels.gemv", "ByteGemv", "__call__"),
    "permute_codes": ("qlens.kernels.gemv", None, "permute_codes"),
    "PreparedLaunch.__call__": ("qlens.kernels.fast_launch", "PreparedLaunch", "__call__"),
}


def time_steps() -> dict[str, list[float]]:
    """Wrap each of ``STEPS`` to record its inclusive host seconds (patched for good)."""
    import importlib

    spent: dict[str, list[float]] = {}
    for label, (module_name, owner_name, name) in STEPS.items():
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        inner = getattr(owner, name)
        record = spent.setdefault(label, [])

        def timed(*args, _inner=inner, _record=record, **kwargs):
            start = time.perf_counter()
            out = _inner(*args, **kwargs)
            _record.append(time.perf_counter() - start)
            return out

        setattr(owner, name, timed)
    return spent


def isolated_costs() -> dict[str, float]:
    """Host microseconds (median of 2000 calls, no sync) of torch calls a quantized linear makes."""
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    calls = {
        "torch.empty(1, 4096)": lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device="cuda"),
        "F.linear bf16 1 x 4096 x 4096": lambda: torch.nn.functional.linear(x, w),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "x.data_ptr()": x.data_ptr,
    }
    costs = {}
    for label, call in calls.items():
        times = []
        for _ in range(2000):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        costs[label] = statistics.median(times) * 1e6
    return costs


def time_linears(model: nn.Module) -> list[float]:
    """Wrap every linear's forward to record its host seconds into the returned list."""
    spent: list[float] = []
    for module in model.modules():
        if isinstance(module, nn.Linear | QuantLinear):
            inner = module.forward

            def timed(x, _inner=inner):
                start = time.perf_counter()
                out = _inner(x)
                spent.append(time.perf_counter() - start)
                return out

            module.forward = timed
    return spent


@torch.inference_mode()
def decode_steps(model: nn.Module, steps: int) -> tuple[float, float]:
    """Median host and wall milliseconds of one-token forwards after a 32-token prefill."""
    from transformers import DynamicCache

    device = next(model.parameters(), None)
    device = torch.device("cuda")
    prompt = torch.randint(0, 1000, (1, 32), device=device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    hosts, walls = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        hosts.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
    return statistics.median(hosts) * 1e3, statistics.median(walls) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1b", choices=("1b", "8b", "moe"))
    parser.add_argument("--schemes", default="int4,fp8-block")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--breakdown", action="store_true", help="time the quantized call's steps")
    args = parser.parse_args()
    shape = shapes(False, None)[args.size]
    print(f"# {shape.label}: one-token eager forwards, median of {args.steps}\n")
    print("| scheme | host ms | wall ms | linear host us (median) | linears a step |")
    print("|---|---|---|---|---|")
    breakdown: dict[str, dict[str, float]] = {}
    for scheme in ["bf16", *args.schemes.split(","), "bf16"]:
        model = build_model(shape, torch.device("cuda"))
        if scheme != "bf16":
            model = qlens.quantize(model, scheme, inplace=True)
        decode_steps(model, 4)
        host, wall = decode_steps(model, args.steps)
        spent = time_linears(model)
        decode_steps(model, 4)
        spent.clear()
        decode_steps(model, args.steps)
        per_step = len(spent) / (args.steps + 1)
        median_us = statistics.median(spent) * 1e6
        print(f"| {scheme} | {host:.2f} | {wall:.2f} | {median_us:.1f} | {per_step:.0f} |")
        if args.breakdown and scheme != "bf16":
            steps = time_steps()
            decode_steps(model, args.steps)
            breakdown[scheme] = {
                label: statistics.median(times) * 1e6 for label, times in steps.items() if times
            }
            for module_name, owner_name, name in STEPS.values():  # unwrap
                import importlib

                module = importlib.import_module(module_name)
                owner = module if owner_name is None else getattr(module, owner_name)
                setattr(owner, name, getattr(owner, name).__kwdefaults__["_inner"])
        del model
        torch.cuda.empty_cache()
    if args.breakdown:
        print(
            "\nisolated host us: " + ", ".join(f"{k} {v:.1f}" for k, v in isolated_costs().items())
        )
    for scheme, steps in breakdown.items():
        print(f"\n{scheme}: inclusive median us per call: ", end="")
        print(", ".join(f"{label} {us:.1f}" for label, us in steps.items()))


if __name__ == "__main__":
    main()
