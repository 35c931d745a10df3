"""Where compiled decode time goes, per scheme against bf16, in two decode loops: transformers'
static-cache compiled ``generate`` (``mode="reduce-overhead"``), which reads the device after
every token, and ``qlens.StaticDecoder`` (the whole step in one CUDA graph, read every 16
tokens). Per loop: the wall time per token against the GPU kernel time per token
(torch.profiler, one more decode), with dynamo's graph breaks, inductor's CUDA-graph skips and
the host events with the most self time.

Run on a CUDA GPU from the repository root:
``python benchmarks/compiled_decode.py --size 8b --schemes int4,nvfp4,mxfp4,fp8-block``; prints
markdown (and writes it to ``$OUT/compiled_decode_<size>.md`` when ``$OUT`` is set). The wall
ratio is what a user gets; the kernel ratio is what the kernels give; the difference between
wall and kernel time per token is what the decode loop does not overlap (host time, the eager
prefill's host time, gaps between kernels). The host events are self times under
torch.profiler, which stretches some of them (dynamo's cache lookup reads milliseconds a token
where a sampling profiler finds a tenth of that): ``static_decode_host.py`` times host and GPU
per step without it."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from benchmarks._e2e_models import build_model, shapes  # noqa: E402
from benchmarks._timing import header, publish  # noqa: E402
from benchmarks.e2e_model import (  # noqa: E402
    PROMPT_TOKENS,
    Workload,
    compiled_generate_kwargs,
    decode_call,
    error_cell,
    for_each_quantized,
    forget_compiled,
    hf_generate,
    static_decoder_generate,
    tokens_per_s,
)


def kernel_profile(run: Callable[[], None]) -> tuple[float, int, Counter, Counter]:
    """GPU kernel microseconds and kernel count of one more compiled decode ``run`` (after it
    ran compiled), the microseconds per kernel name and the host's self microseconds per
    event."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    by_name: Counter = Counter()
    host: Counter = Counter()
    count = 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_name[event.name] += event.time_range.elapsed_us()
            count += 1
        else:
            host[event.name] += event.self_cpu_time_total
    return sum(by_name.values()), count, by_name, host


def measure(
    scheme: str,
    model: torch.nn.Module,
    work: Workload,
    loop: str,
    experts: str = "node",
) -> dict:
    """One row: ``loop`` "hf" is transformers' compiled ``generate``, "static" is
    ``qlens.StaticDecoder`` ("static-unfused": without sibling fusion); ``experts="ops"``
    traces a decode step's routed experts to one ``qlens::experts_linear`` per projection, the gating and the weighted sum
    between them left to inductor, instead of the one ``qlens::moe_decode`` node."""
    from torch._dynamo.utils import counters

    import qlens.modules.traced_experts as traced_experts

    counters.clear()
    torch._dynamo.reset()
    cells: dict = {
        "scheme": scheme if experts == "node" else f"{scheme} (experts as two ops)",
        "loop": loop,
    }
    fused_devices = traced_experts.FUSED_DECODE_DEVICES
    if experts == "ops":
        traced_experts.FUSED_DECODE_DEVICES = frozenset()
    try:
        if loop == "hf":
            generate, kwargs = hf_generate(model), compiled_generate_kwargs(work)
        else:
            fuse = loop == "static"
            generate, kwargs = static_decoder_generate(model, work, fuse), {}
        cells["tok_s"] = tokens_per_s(generate, work, True, **kwargs)
        cells["graph_breaks"] = sum(counters["graph_break"].values())
        cells["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        run = decode_call(generate, work, work.decode_tokens, **kwargs)
        kernel_us, count, by_name, host = kernel_profile(run)
        cells["kernel_us"] = kernel_us / work.decode_tokens
        cells["kernels"] = count / work.decode_tokens
        cells["top"] = [(name, us / work.decode_tokens) for name, us in by_name.most_common(5)]
        cells["host"] = [(name, us / work.decode_tokens) for name, us in host.most_common(6)]
    except Exception as err:  # noqa: BLE001 - the other schemes still run
        cells["error"] = error_cell(err)
    finally:
        traced_experts.FUSED_DECODE_DEVICES = fused_devices
    forget_compiled(model)
    print(f"<!-- {cells} -->", flush=True)
    return cells


LOOPS = {
    "hf": "transformers generate",
    "static": "qlens StaticDecoder",
    "static-unfused": "qlens StaticDecoder, siblings unfused",
}


def table(rows: list[dict]) -> list[str]:
    """Each row against bf16 decoded by the same loop (StaticDecoder's, unfused or not: bf16
    has no quantized linears to fuse)."""
    bf16 = {row["loop"]: row for row in rows if row["scheme"] == "bf16"}
    lines = [
        "| scheme | decode loop | compiled tok/s | vs bf16 | wall us/token | GPU kernel us/token "
        "| kernel speed-up vs bf16 | kernels/token | graph breaks | cudagraph skips |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        loop = LOOPS[row["loop"]]
        if "error" in row:
            lines.append(f"| {row['scheme']} | {loop} | {row['error']} |" + " |" * 7)
            continue
        base = bf16.get(row["loop"], bf16.get("static", {}))
        wall = 1e6 / row["tok_s"]
        speed = row["tok_s"] / base["tok_s"] if "tok_s" in base else float("nan")
        kernel = base.get("kernel_us", float("nan")) / row["kernel_us"]
        lines.append(
            f"| {row['scheme']} | {loop} | {row['tok_s']:.1f} | {speed:.2f}x | {wall:.0f} | "
            f"{row['kernel_us']:.0f} | {kernel:.2f}x | {row['kernels']:.0f} | "
            f"{row['graph_breaks']} | {row['cudagraph_skips']} |"
        )
    lines += ["", "Largest kernels per scheme (us per token, share of kernel time):", ""]
    for row in rows:
        if "top" in row:
            parts = [
                f"`{name[:60]}` {us:.0f} ({us / row['kernel_us']:.0%})" for name, us in row["top"]
            ]
            lines.append(f"- {row['scheme']}, {LOOPS[row['loop']]}: " + "; ".join(parts))
    lines += ["", "Host events with the most self time per token (us, under the profiler):", ""]
    for row in rows:
        if "host" in row:
            parts = [f"`{name[:50]}` {us:.0f}" for name, us in row["host"]]
            lines.append(f"- {row['scheme']}, {LOOPS[row['loop']]}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("1b", "8b", "moe"), default="8b")
    parser.add_argument("--schemes", default="int4,nvfp4,mxfp4,fp8-block")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--loops",
        default="hf,static",
        help="decode loops to time: hf (transformers' compiled generate), static "
        "(qlens.StaticDecoder), static-unfused (its quantized siblings launched one by one)",
    )
    parser.add_argument(
        "--experts-as-ops",
        action="store_true",
        help="also time each scheme with a decode step's routed experts traced to two "
        "qlens::experts_linear ops instead of one qlens::moe_decode node (MoE only)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    shape = shapes(False, None)[args.size]
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    vocab = shape.config["vocab_size"]
    work = Workload(
        tokens=torch.randint(0, vocab, (1, 8), generator=gen).to(device),
        prompt=torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(device),
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        compile_backend="inductor",
    )
    loops = args.loops.split(",")
    if not set(loops) <= set(LOOPS):
        parser.error(f"--loops takes {', '.join(LOOPS)}, got {args.loops}")
    base = build_model(shape, device)
    rows = [measure("bf16", base, work, loop) for loop in loops if loop != "static-unfused"]

    def run(scheme: str, model: torch.nn.Module) -> None:
        rows.extend(measure(scheme, model, work, loop) for loop in loops)
        if args.experts_as_ops:
            rows.extend(measure(scheme, model, work, loop, experts="ops") for loop in loops)

    for_each_quantized(base, args.schemes.split(","), run)
    text = "\n".join(
        [
            header(
                f"Compiled static-cache decode, {shape.label}: wall time against kernel time",
                f"transformers' compiled static-cache generate (reduce-overhead) and "
                f"qlens.StaticDecoder (inductor, CUDA graphs, the host reading the device every "
                f"16 tokens), {args.decode_tokens} greedy tokens after a {PROMPT_TOKENS}-token "
                f"prompt, median of {args.repeats} after two compiling runs; kernel time: "
                "torch.profiler over one more decode (the eager prefill's kernels included), "
                "per new token",
                ["transformers"],
            ),
            *table(rows),
        ]
    )
    publish(text, f"compiled_decode_{args.size}.md")
    return text


if __name__ == "__main__":
    main()
