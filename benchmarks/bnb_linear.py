"""bitsandbytes linears (NF4 or LLM.int8): their own forward against the same modules rerouted
through qlens.

For each 8B decode layer and row count: a bitsandbytes ``Linear4bit`` (NF4, blocks of 64, bf16
compute, as transformers' default ``BitsAndBytesConfig`` builds it; its own forward is
bitsandbytes' one-row GEMV, or dequantize then cuBLAS) or with ``--format int8`` a
``Linear8bitLt`` (LLM.int8, outlier threshold 6.0 as transformers' default; its own forward
rounds the activations to int8), then the same modules rerouted with
``qlens.reroute_quantized_modules(force=True)`` (qlens' kernels read bitsandbytes' bytes in
place), against bf16 ``F.linear``; for NF4 also the packed GEMV at every row count (the launch
the tables would choose without bitsandbytes' one-row rule). Timed two ways: GPU microseconds from CUDA-graph replays
over enough module copies to exceed the L2 cache, and eager wall and host microseconds of
back-to-back calls (what a researcher's eager forward pays). The outputs of both forwards are
compared with the float32 product of the dequantized weight.

Run on a CUDA GPU with bitsandbytes installed:
``python benchmarks/bnb_linear.py [--format nf4|int8] [--rows 1,8,32] [--nested]``; prints
markdown and, when ``$OUT`` is set, writes it to ``$OUT/bnb_<format>_linear_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from _timing import (
    DECODE_LAYERS_8B,
    copies_for,
    header,
    host_and_wall_us,
    publish,
    rel_err,
    seeded_weight,
    time_graph,
    time_or_nan,
)
from torch import nn

TIMING = (
    "GPU: CUDA-graph replays over module copies exceeding 3x the L2 cache, median of 20; eager: "
    "median of five rounds of 500 back-to-back calls after 50 warm-up calls, host until the "
    "last call returns, wall until a sync after them"
)


def nf4_modules(weight: torch.Tensor, copies: int, nested: bool) -> list[nn.Module]:
    """``copies`` bitsandbytes NF4 ``Linear4bit`` modules of ``weight`` (each its own bytes)."""
    import bitsandbytes as bnb

    n, k = weight.shape
    out = []
    for _ in range(copies):
        module = bnb.nn.Linear4bit(
            k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta"
        )
        module.weight = bnb.nn.Params4bit(
            weight.cpu().clone(), requires_grad=False, quant_type="nf4",
            compress_statistics=nested, module=module,
        ).to(weight.device)  # fmt: skip
        out.append(module)
    return out


def int8_modules(weight: torch.Tensor, copies: int) -> list[nn.Module]:
    """``copies`` bitsandbytes LLM.int8 ``Linear8bitLt`` modules of ``weight``."""
    import bitsandbytes as bnb

    n, k = weight.shape
    out = []
    for _ in range(copies):
        module = bnb.nn.Linear8bitLt(
            k, n, bias=False, has_fp16_weights=False, threshold=6.0, device="meta"
        )
        module.weight = bnb.nn.Int8Params(
            weight.cpu().clone(), requires_grad=False, has_fp16_weights=False
        ).to(weight.device)
        out.append(module)
    return out


def measure(n: int, k: int, rows: int, fmt: str, nested: bool) -> dict[str, float]:
    """Times (us) and errors of one layer at ``rows`` rows."""
    import qlens
    from qlens.kernels import choose_config, quantized_linear
    from qlens.quant.adopt import adopt_module
    from qlens.quant.dequantize import dequantize

    weight = seeded_weight(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bf16 = [weight] + [weight.clone() for _ in range(copies_for(weight.nbytes) - 1)]
    cells = {"bf16 gpu": time_graph([functools.partial(F.linear, x, w) for w in bf16])}
    cells["bf16 host"], cells["bf16 wall"] = host_and_wall_us(
        functools.partial(F.linear, x, weight)
    )
    del bf16
    if fmt == "nf4":
        modules = nf4_modules(weight, copies_for(n * k // 2), nested)
    else:
        modules = int8_modules(weight, copies_for(n * k))
    exact = F.linear(x.float(), dequantize(adopt_module(modules[0]), torch.float32))
    with torch.no_grad():
        own = modules[0](x)
        cells["bnb gpu"] = time_or_nan(lambda: [m(x) for m in modules])
        cells["bnb gpu"] /= len(modules)
        cells["bnb host"], cells["bnb wall"] = host_and_wall_us(functools.partial(modules[0], x))
        holder = nn.ModuleList(modules)
        qlens.reroute_quantized_modules(holder, force=True)
        ours = modules[0](x)
        cells["qlens gpu"] = time_graph([functools.partial(m, x) for m in modules])
        cells["qlens host"], cells["qlens wall"] = host_and_wall_us(
            functools.partial(modules[0], x)
        )
        # The packed GEMV on these rows, as the launch tables would give it without the
        # bitsandbytes rule (BNB4_PACKED_GEMV_MAX_M): the evidence for that rule.
        cells["packed gpu"] = float("nan")
        if fmt == "nf4":
            payloads = [adopt_module(m) for m in modules]
            packed = choose_config(rows, n, k, x.device, packed_words=True)
            cells["packed gpu"] = time_graph(
                [functools.partial(quantized_linear, x, p, config=packed) for p in payloads]
            )
    cells["bnb err"], cells["qlens err"] = rel_err(own, exact), rel_err(ours, exact)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="comma-separated row counts")
    parser.add_argument("--format", choices=("nf4", "int8"), default="nf4")
    parser.add_argument("--nested", action="store_true", help="NF4: double-quantized absmax")
    args = parser.parse_args()
    name = "NF4" if args.format == "nf4" else "LLM.int8"
    described = (
        f"NF4, blocks of 64, {'nested' if args.nested else 'flat'} absmax"
        if args.format == "nf4"
        else "LLM.int8, outlier threshold 6.0"
    )
    lines = [
        header(f"bitsandbytes {name} linears: own forward vs rerouted through qlens", TIMING,
               ["transformers", "bitsandbytes"]),
        f"{described}, bf16 activations. "
        "Ratios: bnb's time / qlens' (x > 1: qlens faster), bf16's time / qlens'.",
        "",
        "| layer N x K | rows | bf16 GPU us | bnb GPU us | qlens GPU us | GPU vs bnb | GPU vs bf16 "
        "| packed GEMV GPU us "
        "| bf16 wall us | bnb wall us | qlens wall us | wall vs bnb | wall vs bf16 | bf16 host us "
        "| bnb host us | qlens host us | bnb rel err | qlens rel err |",
        "|---" * 18 + "|",
    ]  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        for n, k in DECODE_LAYERS_8B:
            c = measure(n, k, rows, args.format, args.nested)
            lines.append(
                f"| {n} x {k} | {rows} | {c['bf16 gpu']:.1f} | {c['bnb gpu']:.1f} | "
                f"{c['qlens gpu']:.1f} | {c['bnb gpu'] / c['qlens gpu']:.2f}x | "
                f"{c['bf16 gpu'] / c['qlens gpu']:.2f}x | {c['packed gpu']:.1f} | "
                f"{c['bf16 wall']:.1f} | "
                f"{c['bnb wall']:.1f} | {c['qlens wall']:.1f} | "
                f"{c['bnb wall'] / c['qlens wall']:.2f}x | {c['bf16 wall'] / c['qlens wall']:.2f}x | "
                f"{c['bf16 host']:.1f} | {c['bnb host']:.1f} | {c['qlens host']:.1f} | "
                f"{c['bnb err']:.1e} | {c['qlens err']:.1e} |"
            )
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    publish("\n".join(lines), f"bnb_{args.format}_linear_h200.md")


if __name__ == "__main__":
    main()
