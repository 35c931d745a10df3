"""GPU timing and result headers shared by the benchmark scripts (not part of the qlens package)."""

from __future__ import annotations

import copy
import datetime
import functools
import importlib.metadata
import itertools
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import no_type_check

import torch
import triton
import triton.language as tl
from triton.errors import TritonError

from qlens.kernels.configs import LinearConfig
from qlens.quant.payload import QuantPayload

# The layers (N, K) every kernel benchmark times, the 8B decode layers (fused qkv, o, fused
# gate_up, down, in model order) and the packed 4-bit schemes they time.
BENCHMARK_LAYERS = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
DECODE_LAYERS_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
PACKED_4BIT_SCHEMES: tuple[tuple[str, dict], ...] = (
    ("int4", {"group_size": 128}),
    ("mxfp4", {}),
    ("nvfp4", {}),
)


def select_schemes(
    schemes: Sequence[tuple[str, dict]], names: str | None
) -> list[tuple[str, dict]]:
    """The ``(scheme, options)`` pairs whose scheme is in the comma-separated ``names`` (all of
    them when ``names`` is ``None``): a benchmark's ``--schemes`` option."""
    return [c for c in schemes if names is None or c[0] in names.split(",")]


def time_graph(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Median microseconds of one call, from CUDA-graph replays of ``calls`` run back to back.

    Pass one call per copy of the inputs so that together they exceed the L2 cache: then every
    call streams its weights from memory, as in a model where each layer has its own weights.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and allocate outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    _warm_up(graph)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    times.sort()
    return times[len(times) // 2]


WARM_UP_MS = 50.0


def _warm_up(graph: torch.cuda.CUDAGraph) -> None:
    """Replay ``graph`` for about ``WARM_UP_MS`` of GPU time, so that the clocks have left an
    idle state before timing (a first timing after host-side work otherwise reads ~10% slow)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    for _ in range(min(200, int(WARM_UP_MS / max(start.elapsed_time(end), 1e-3)))):
        graph.replay()
    torch.cuda.synchronize()


def time_eager(call: Callable[[], object], reps: int = 10) -> float:
    """Median microseconds of ``call`` launched eagerly (for code that cannot be graph-captured)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def median_wall_s(call: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of ``call`` over ``repeats`` runs after ``warmup`` untimed ones,
    synchronizing the GPU (when there is one) around each run: for whole-model work (a prefill,
    a ``generate``) whose host time counts."""

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def time_eager_loop(call: Callable[[], object], calls: int = 500) -> float:
    """Wall microseconds per call over ``calls`` back-to-back calls of ``call``, synchronized
    once at the end: what an eager loop pays, host work included (``time_eager`` times one
    call between events)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_and_wall_us(call: Callable[[], object], calls: int = 500) -> tuple[float, float]:
    """Median over five rounds of ``calls`` back-to-back calls (after 50 warm-up calls) of
    (host, wall) microseconds per call: host until the last call returns, without a sync;
    wall until a sync after them returns."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((issued - start) / calls * 1e6)
        wall.append((done - start) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


# What a launch that cannot run raises: a shape or tile the code rejects, a CUDA error, or Triton's
# own (shared memory or registers exceeded, a compile failure).
LAUNCH_ERRORS = (RuntimeError, ValueError, TritonError)


def time_or_nan(call: Callable[[], object], graph: bool = True, replays: int = 10) -> float:
    """``time_graph`` (or ``time_eager`` when ``graph`` is false) of ``call``; NaN, with an HTML
    comment printed, where it fails (a peer that cannot run this input, a launch that does not
    fit)."""
    try:
        return time_graph([call], replays=replays) if graph else time_eager(call)
    except (*LAUNCH_ERRORS, TypeError, AssertionError) as err:
        print(f"<!-- failed: {str(err)[:300]} -->", flush=True)
        return float("nan")


def copies_for(nbytes: int, l2_bytes: int = 60 << 20, most: int = 16) -> int:
    """How many copies of an input of ``nbytes`` together exceed three times the L2 cache."""
    return max(1, min(most, -(-3 * l2_bytes // max(nbytes, 1))))


@triton.jit
@no_type_check
def _copy_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def copy_bandwidths(nbytes: int = 2 << 30) -> dict[str, float]:
    """Device-to-device copy bandwidth in TB/s (bytes read plus bytes written) of three copies of
    ``nbytes``: ``Tensor.copy_`` (a memcpy), a torch elementwise kernel and a Triton kernel."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    block = 4096
    copies = {
        "Tensor.copy_": lambda: dst.copy_(src),
        "torch.mul": lambda: torch.mul(src, 1.0, out=dst),
        "Triton": lambda: _copy_kernel[(src.numel() // block,)](src, dst, BLOCK=block),
    }
    return {
        name: 2 * nbytes / time_graph([call] * 4, replays=20) / 1e6 for name, call in copies.items()
    }


ROTATED_TIMING = (
    "CUDA-graph replays (launch gaps excluded), inputs rotated across enough copies to exceed 3x "
    "the L2 cache, each graph replayed for 50 ms before timing, median of 20 replays"
)
ONE_CALL_TIMING = (
    "CUDA-graph replays of one call whose bytes exceed the L2 cache several times (launch gaps "
    "excluded), each graph replayed for 50 ms before timing, median of 10 replays"
)


def device_name() -> str:
    """The GPU and its SM count, or the CPU when no GPU is visible."""
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return f"{torch.cuda.get_device_name()} ({sms} SMs)"
    return f"none: CPU {platform.machine()}, {os.cpu_count()} logical cores"


def header(title: str, timing: str = ROTATED_TIMING, libraries: Sequence[str] = ()) -> str:
    """Markdown preamble: date, GPU, software versions (torch, triton, CUDA, Python and the
    installed ``libraries``), the exact command and how it timed."""
    extra = "".join(f", {name} {importlib.metadata.version(name)}" for name in libraries)
    lines = [
        f"# {title}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- GPU: {device_name()}",
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
        f"Python {platform.python_version()}{extra}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- timing: {timing}",
    ]
    return "\n".join(lines) + "\n\n"


def clone_payload(payload: QuantPayload) -> QuantPayload:
    """A copy of ``payload`` with its own tensors (one more weight to rotate through)."""
    out = copy.copy(payload)
    for name in ("data", "scales", "zeros", "global_scale"):
        t = getattr(payload, name)
        if t is not None:
            setattr(out, name, t.clone())
    return out


def rotation(first: torch.Tensor | QuantPayload) -> list:
    """``first`` and enough copies of it that together they exceed three times the L2 cache
    (``copies_for``), to time each call on weights streamed from memory."""
    if isinstance(first, torch.Tensor):
        return [first] + [first.clone() for _ in range(copies_for(first.nbytes) - 1)]
    return [first] + [clone_payload(first) for _ in range(copies_for(first.nbytes) - 1)]


def seeded_weight(n: int, k: int, device: torch.device | str = "cuda") -> torch.Tensor:
    """The layer a kernel benchmark times: ``torch.manual_seed(0)``, then a bf16 ``[n, k]``
    normal weight of standard deviation 0.02 (so the weight, and what is drawn after it,
    repeat across runs)."""
    torch.manual_seed(0)
    return torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02


def time_bf16_linear(weights: Sequence[torch.Tensor], x: torch.Tensor) -> float:
    """``time_graph`` of ``F.linear(x, w)`` over ``weights`` (a ``rotation`` of one bf16
    weight): the baseline every kernel benchmark compares with."""
    return time_graph([functools.partial(torch.nn.functional.linear, x, w) for w in weights])


def time_linear(
    payloads: Sequence[QuantPayload],
    x: torch.Tensor,
    config: LinearConfig | None = None,
    *,
    w8a8: bool = False,
) -> float:
    """``time_graph`` of ``quantized_linear(x, p, config=config, w8a8=w8a8)`` over ``payloads``
    (a ``rotation`` of one weight)."""
    from qlens.kernels.dispatch import quantized_linear

    return time_graph(
        [functools.partial(quantized_linear, x, p, config=config, w8a8=w8a8) for p in payloads]
    )


def time_launches(
    payloads: Sequence[QuantPayload],
    x: torch.Tensor,
    configs: Sequence[LinearConfig],
    exact: torch.Tensor,
) -> tuple[list[float], float]:
    """``time_linear`` of each launch in ``configs`` (NaN, with an HTML comment printed, where
    one fails to launch) and the worst ``rel_err`` of their outputs on ``payloads[0]`` against
    ``exact``."""
    from qlens.kernels.dispatch import quantized_linear

    times, worst = [], 0.0
    for cfg in configs:
        try:
            times.append(time_linear(payloads, x, cfg))
            worst = max(worst, rel_err(quantized_linear(x, payloads[0], config=cfg), exact))
        except LAUNCH_ERRORS as err:
            print(f"<!-- {cfg} failed: {str(err)[:200]} -->", flush=True)
            times.append(float("nan"))
    return times, worst


def launch_label(cfg: LinearConfig) -> str:
    """A launch in a table header: path, ``BLOCK_M x BLOCK_N x BLOCK_K``, warps, stages, splits."""
    return (
        f"{cfg.path} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
        f"st{cfg.num_stages} s{cfg.split_k}"
    )


def launch_sweep(
    shapes: Sequence[tuple[int, int]],
    row_counts: Sequence[int],
    schemes: Sequence[tuple[str, dict]],
    configs: Sequence[LinearConfig],
    device: torch.device | str = "cuda",
) -> list[str]:
    """Markdown table of each ``[n, k]`` layer, row count and weight-only scheme: bf16
    ``F.linear``, the dispatcher's launch (``default_config``) and every launch of ``configs``,
    in microseconds on weights streamed from memory, then the best speed-up over bf16 and over
    the dispatcher, and the worst relative error of any launch against the float32 product with
    the dequantized weight. Rows are printed as they are timed."""
    from qlens.kernels.dequant import dequantize_triton
    from qlens.kernels.dispatch import default_config, quantized_linear
    from qlens.quant.quantize import quantize_weight

    rows = [
        "| N x K | scheme | M | bf16 us | dispatcher's launch | its us | "
        + " | ".join(launch_label(cfg) for cfg in configs)
        + " | best vs bf16 | best vs dispatcher | worst rel. err |",
        "|---|---|---|---|---|---|" + "---|" * len(configs) + "---|---|---|",
    ]
    for (n, k), m in itertools.product(shapes, row_counts):
        w = seeded_weight(n, k, device)
        bf16 = rotation(w)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        t_bf16 = time_bf16_linear(bf16, x)
        del bf16
        for scheme, options in schemes:
            p0 = quantize_weight(w, scheme, **options)
            payloads = rotation(p0)
            exact = torch.nn.functional.linear(x.float(), dequantize_triton(p0, torch.float32))
            chosen = default_config(p0, m, torch.device(device))
            t_chosen = time_linear(payloads, x, chosen)
            times, worst = time_launches(payloads, x, configs, exact)
            worst = max(worst, rel_err(quantized_linear(x, p0, config=chosen), exact))
            best = min([t_chosen, *(t for t in times if t == t)])
            name = scheme + "".join(f" {key}={value}" for key, value in options.items())
            rows.append(
                f"| {n} x {k} | {name} | {m} | {t_bf16:.1f} | {launch_label(chosen)} | "
                f"{t_chosen:.1f} | " + " | ".join(f"{t:.1f}" for t in times)
                + f" | {t_bf16 / best:.2f}x | {t_chosen / best:.2f}x | {worst:.1e} |"
            )  # fmt: skip
            print(rows[-1], flush=True)
            del payloads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``|out - ref| / |ref|``, computed in float64."""
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64).norm() / ref64.norm()).item()


def gpu_tag(name: str | None = None) -> str:
    """The short, lower-case model of a GPU name for result file names ("NVIDIA H100 80GB HBM3"
    -> "h100"); ``name`` defaults to the visible GPU's; "cpu" without one."""
    if name is None:
        if not torch.cuda.is_available():
            return "cpu"
        name = torch.cuda.get_device_name()
    model = re.search(r"\b(G?H\d+|[AB]\d{2,3}|L\d+S?)\b", name)
    return (model.group(1) if model else "gpu").lower()


def result_filename(filename: str, name: str | None = None) -> str:
    """``filename`` with its "_h200" (the GPU the scripts were written on) replaced by the
    tag of the GPU the run is on, so a run elsewhere does not pose as an H200's."""
    return filename.replace("_h200", f"_{gpu_tag(name)}")


def publish(text: str, filename: str) -> None:
    """Print a benchmark's markdown and, when ``$OUT`` is set, also write it to ``$OUT/filename``
    (its "_h200" naming the GPU the run is on: the scripts' ``$OUT/<name>_<gpu>.md``)."""
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], result_filename(filename)), "w") as f:
            f.write(text + "\n")
