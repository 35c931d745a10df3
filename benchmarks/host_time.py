"""Python (host) time of one eager quantized-linear call, kernel launches excluded.

Runs on the CPU in Triton's interpreter with every Triton launch of the GEMVs replaced by a
no-op, so what is timed is qlens' own dispatch: checks, configuration, the activation
regrouping and argument building. Eager decode on a GPU pays this on every call. Also timed:
the modules' whole forward (``QuantLinear`` and ``QuantExperts`` on one token, their plans
forced onto the kernel route the CPU otherwise leaves for the reference) next to ``F.linear``
on a tiny shape (torch's own dispatch cost on this CPU), and the direct launch of a compiled
kernel (a stand-in that records the call) through ``FastLaunch.launch`` and a prepared launch.
Timed last, with grad mode off: ``torch.ops.qlens.linear`` on a QuantLinear's traced tensors,
what a compiled graph outside CUDA graphs calls for each quantized linear on every forward.

Run: ``TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/host_time.py`` from the repository
root (``PYTHONPATH`` names the tree whose qlens is timed); prints markdown and, when ``$OUT``
is set, writes it to ``$OUT/host_time_cpu.md``.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from _timing import publish

import qlens.kernels.gemv as gemv
import qlens.kernels.plan as plan
from qlens.kernels import experts_linear, quantized_linear
from qlens.kernels.fast_launch import FastLaunch
from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.expert_gate import ExpertGate
from qlens.quant.quantize import quantize_weight

CALLS = 500
ROUNDS = 20


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: None


def _us_per_call(call) -> float:
    """The fastest of ``ROUNDS`` rounds' mean CPU microseconds per call of this thread (torch
    runs on this thread alone: on a shared CPU, time spent waiting for a core is not counted,
    and the fastest round is the one least slowed by other processes' cache traffic)."""
    for _ in range(50):
        call()
    rounds = []
    for _ in range(ROUNDS):
        start = time.thread_time()
        for _ in range(CALLS):
            call()
        rounds.append((time.thread_time() - start) / CALLS * 1e6)
    return min(rounds)


class _Compiled:
    """Stands in for a compiled Triton kernel: ``run`` and ``launch_metadata`` do nothing."""

    function = None
    packed_metadata = None

    def run(self, *call: object) -> None:
        return None

    def launch_metadata(self, *call: object) -> None:
        return None


class _Runtime:
    """A direct-launch runtime on device 0 with no launch hooks."""

    def current_device(self) -> int:
        return 0

    def current_stream(self, device: int) -> int:
        return 0

    def hooks(self) -> tuple[None, None]:
        return None, None


class _CompilingKernel:
    """A JIT function's normal launch that hands back a ``_Compiled``."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.params = kernel.params  # type: ignore[attr-defined]
        self.signature = kernel.signature  # type: ignore[attr-defined]
        self.__name__ = "compiling"

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: _Compiled()


def _direct_launches() -> dict[str, object]:
    """The packed GEMV's direct launch (one row, int4 4096 x 4096) through ``FastLaunch.launch``
    with its per-call key of every argument, and through the plan's prepared launch."""
    from triton.runtime.jit import JITFunction

    kernel = _CompilingKernel(JITFunction(gemv.packed_gemv_kernel.fn))
    recorded: list[tuple[tuple, dict]] = []
    gemv.PACKED_GEMV = FastLaunch(_NoLaunch())
    original = FastLaunch.launch

    def record(self, grid, *args, **options):
        recorded.append((grid, args, options))

    FastLaunch.launch = record  # type: ignore[method-assign]
    try:
        payload = quantize_weight(torch.randn(4096, 4096), "int4", group_size=128)
        x = torch.randn(1, 4096)
        quantized_linear(x, payload)
    finally:
        FastLaunch.launch = original  # type: ignore[method-assign]
    label = "direct launch of the packed GEMV, int4 4096 x 4096, one row (stand-in kernel)"
    direct = FastLaunch(kernel)
    direct._runtime, direct._resolved = _Runtime(), True
    if recorded:  # the tree before prepared launches: one launch call with every argument
        grid, args, options = recorded[0]
        return {label: lambda: direct.launch(grid, *args, **options)}
    prepared = plan.LinearPlan(payload, x.device, route="kernel")
    prepared(x)
    launch = prepared._calls[x.shape, x.dtype, True].launch  # type: ignore[attr-defined]
    launch.launcher = direct
    out = torch.empty(1, 4096)
    return {label: lambda: launch(x, out)}


def _force_one_launch_experts() -> None:
    """The experts' one-launch GEMV on CPU tensors (the modules keep it for accelerators)."""
    try:
        from qlens.kernels.experts import ExpertsPlan
    except ImportError:  # the tree before ExpertsPlan asked the modules' dispatch
        import qlens.modules.dispatch as dispatch

        dispatch.experts_in_one_launch = lambda *args: True  # type: ignore[attr-defined]
    else:
        ExpertsPlan.one_launch = lambda self, rows: True  # type: ignore[method-assign]


def _modules() -> dict[str, object]:
    """One-token forwards of a QuantLinear and a QuantExperts on the kernel route."""
    plan.choose_route = lambda payload, device: ("kernel", None)  # type: ignore[assignment]
    _force_one_launch_experts()
    linear = QuantLinear(quantize_weight(torch.randn(4096, 4096), "int4", group_size=128))
    gate_up = quantize_weight(torch.randn(8, 1024, 1024), "int4", group_size=128)
    down = quantize_weight(torch.randn(8, 1024, 512), "int4", group_size=128)
    experts = QuantExperts(gate_up, down, ExpertGate("stacked", "silu"))
    fused = QuantExperts(gate_up, down, ExpertGate("stacked", "silu"))
    x, h = torch.randn(1, 4096), torch.randn(1, 1024)
    index, weights = torch.tensor([[1, 5]]), torch.tensor([[0.6, 0.4]])
    small, small_w = torch.randn(1, 16), torch.randn(16, 16)
    label = "QuantExperts forward, int4 8 x 1024 x 1024 and 8 x 1024 x 512, one token, top 2"
    return {
        "F.linear, fp32 1 x 16 by 16 x 16 (torch's dispatch)": lambda: F.linear(small, small_w),
        "QuantLinear forward, int4 4096 x 4096, one token": lambda: linear(x),
        label: lambda: experts(h, index, weights),
        **_fused_experts(f"{label}, fused decode", fused, h, index, weights),
    }


def _fused_experts(label: str, experts: QuantExperts, *call: torch.Tensor) -> dict[str, object]:
    """``experts`` on the fused MoE decode (its plans taken as an accelerator's), launches
    stubbed out; nothing on a tree without it."""
    try:
        import qlens.kernels.moe_decode as moe_decode
    except ImportError:
        return {}
    for name in ("_GATE_UP", "_DOWN_SUM"):
        setattr(moe_decode, name, FastLaunch(_NoLaunch()))
    for prefix in ("gate_up", "down"):  # the plans, built before any forward asks them
        experts.experts_plan(prefix, call[0])._accelerated = True
    return {label: lambda: experts(*call)}


def _direct_launcher(kernel: Any) -> FastLaunch:
    """A direct launch of a stand-in compiled ``kernel`` (a ``triton.jit`` function)."""
    from triton.runtime.jit import JITFunction

    launcher = FastLaunch(_CompilingKernel(JITFunction(kernel.fn)))
    launcher._runtime, launcher._resolved = _Runtime(), True
    return launcher


def _sibling_projections() -> dict[str, object]:
    """q, k and v QuantLinears of an 8B layer (int4, one token) sharing one launch, and each
    launching on its own, through direct launches of stand-in compiled kernels (everything a
    GPU launch does on the host but Triton's C launcher and the driver)."""

    import qlens.kernels.sibling_gemv as sibling_gemv
    from qlens.modules.siblings import SiblingGroup

    gemv.PACKED_GEMV = _direct_launcher(gemv.packed_gemv_kernel)
    sibling_gemv._PACKED_SIBLINGS = _direct_launcher(sibling_gemv.packed_siblings_gemv_kernel)
    payloads = [
        quantize_weight(torch.randn(n, 4096), "int4", group_size=128) for n in (4096, 1024, 1024)
    ]
    shared = [QuantLinear(p) for p in payloads]
    SiblingGroup(shared)
    alone = [QuantLinear(p) for p in payloads]
    x = torch.randn(1, 1, 4096)

    def projections(modules: list[QuantLinear]) -> object:
        return lambda: [module(x) for module in modules]

    label = "q, k and v QuantLinears, int4 4096/1024/1024 x 4096, one token, direct launches"
    return {
        f"{label}: one shared launch": projections(shared),
        f"{label}: one launch each": projections(alone),
    }


def _direct_stand_ins() -> None:
    """Every launch a linear plan prepares, through direct launches of stand-in compiled
    kernels, chosen from the H200's launch tables (a prompt's rows take the GPU's launch)."""
    import qlens.kernels.configs as configs
    import qlens.kernels.splits as splits
    import qlens.kernels.weight_only as weight_only

    configs.interpreting = lambda: False  # type: ignore[assignment]
    configs.gpu_name = lambda device: "NVIDIA H200"  # type: ignore[assignment]
    configs.sm_count = lambda device: 132  # type: ignore[assignment]
    gemv.PACKED_GEMV = _direct_launcher(gemv.packed_gemv_kernel)
    gemv._GEMV = _direct_launcher(gemv._gemv_kernel)
    splits._REDUCE = _direct_launcher(splits._reduce_splits_kernel)
    weight_only._WEIGHT_ONLY = _direct_launcher(weight_only._weight_only_kernel)


def _linear_op_calls(linear: QuantLinear) -> dict[str, object]:
    """``torch.ops.qlens.linear.default`` on ``linear``'s traced tensors (its buffers and spec
    key, as a compiled forward passes them: the module offered its payload), bf16, one row and
    32 (a prompt), each next to the module's plan called directly (what the op runs, without
    the dispatcher). The caller keeps ``linear`` alive, as a compiled model does."""
    from qlens.modules.payload_buffers import traced_payload

    tensors, key = traced_payload(linear._buffers, linear._traced_weight)
    op = torch.ops.qlens.linear.default
    shape = f"{linear.out_features} x {linear.in_features}"
    label = f"torch.ops.qlens.linear, int4 {shape}, bf16, grad mode off, direct launches"
    calls = {}
    for rows in (1, 32):
        x = torch.randn(rows, linear.in_features, dtype=torch.bfloat16)
        name = f"{label}: {rows} row{'s' * (rows > 1)}"
        calls[name] = functools.partial(op, x, tensors, key, None)
        calls[f"{name}, the module's plan called directly"] = functools.partial(
            linear.linear_plan("weight", x), x, None
        )
    return calls


def _timed_row(name: str, call: object) -> str:
    """The table row of ``call``'s time, printed as soon as it is measured."""
    row = f"| {name} | {_us_per_call(call):.1f} |"
    print(row, flush=True)
    return row


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: the calls run on CPU tensors")
    torch.manual_seed(0)
    # The no-op launches leave outputs uninitialized; denormals there would slow the torch ops
    # after them (the experts' weighted sum) far beyond what they cost on real values.
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)  # host dispatch only; no thread pool waking per op
    direct = _direct_launches()
    gemv.PACKED_GEMV = FastLaunch(_NoLaunch())
    gemv._GEMV = FastLaunch(_NoLaunch())
    int4 = quantize_weight(torch.randn(4096, 4096), "int4", group_size=128)
    fp8 = quantize_weight(torch.randn(4096, 4096), "fp8-block")
    experts = quantize_weight(torch.randn(8, 512, 1024), "int4", group_size=128)
    x, xe, ids = torch.randn(1, 4096), torch.randn(2, 1024), torch.tensor([1, 5])
    cases = {
        "quantized_linear, int4 4096 x 4096, one row": lambda: quantized_linear(x, int4),
        "quantized_linear, fp8-block 4096 x 4096, one row": lambda: quantized_linear(x, fp8),
        "experts_linear, int4 8 x 512 x 1024, two routed rows": lambda: experts_linear(
            xe, experts, ids, ids_in_range=True
        ),
        **_modules(),
        **direct,
        **_sibling_projections(),
    }
    lines = [
        "# Host time per eager call, Triton launches excluded",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- command: `TRITON_INTERPRET=1 PYTHONPATH=. python {' '.join(sys.argv)}`",
        f"- timing: this thread's CPU time (torch on one thread), fastest of {ROUNDS} rounds "
        f"of {CALLS} calls each, after 50 warm-up calls",
        "",
        "| call | us of Python per call |",
        "|---|---|",
    ]
    lines += [_timed_row(name, call) for name, call in cases.items()]
    _direct_stand_ins()  # after the rows above: it changes the launch tables and launchers
    linear = QuantLinear(quantize_weight(torch.randn(14336, 4096), "int4", group_size=128))
    with torch.no_grad():
        lines += [_timed_row(name, call) for name, call in _linear_op_calls(linear).items()]
    publish("\n".join(lines), "host_time_cpu.md")


if __name__ == "__main__":
    main()
