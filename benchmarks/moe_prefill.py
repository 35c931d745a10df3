"""MoE prefill: one layer's routed experts over a 1024-token prefill, packed 4-bit and
fp8-block, against bf16.

For Qwen3-MoE experts blocks (hidden 2048, moe_intermediate 768, top-8; 64 experts as in
``e2e_model.py --sizes moe``, and 128 as in Qwen3-30B-A3B) and 1024 tokens (8192 routed rows)
this times, eagerly (CUDA events around each call, median of 10 after 3 warm-up calls):

- qlens: the ``QuantExperts`` forward as the library runs it: from
  ``DECODED_EXPERTS_MIN_ROWS_PER_EXPERT`` bf16 rows an expert on a Hopper GPU, packed 4-bit
  experts all decoded in one launch,
  then ``torch._grouped_mm`` (``qlens.kernels.decoded_experts``), else each projection one
  launch of qlens' grouped kernel over all experts (``qlens.kernels.grouped_experts``);
- Triton grouped: the same module held to qlens' grouped kernel;
- qlens expert by expert: the same module with the grouped path turned off (each used
  expert's two linears, the path prefill took before);
- bf16: transformers' ``Qwen3MoeExperts`` on the bf16 weights under its prefill experts
  implementations (``eager``: a loop over the used experts; ``grouped_mm``: torch's grouped
  GEMM), and the ratio of qlens grouped to the faster of them.

Each qlens result is checked against the float32 block on the dequantized weights.
``--sweep`` adds a table of the grouped launch alone on each projection of the 64-expert block
under a few tile configurations (the default one first), for tuning ``grouped_config``.

Run on a CUDA GPU: ``python benchmarks/moe_prefill.py`` (``--tokens N``,
``--schemes int4,fp8-block``, ``--sweep``); prints markdown and, when ``$OUT`` is set, writes it to ``$OUT/moe_prefill_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import transformers
from _timing import LAUNCH_ERRORS, PACKED_4BIT_SCHEMES, header, publish, rel_err, select_schemes
from _timing import time_eager as _time_eager

import qlens.kernels.experts as experts_module
from qlens.kernels.code_order import permute_codes
from qlens.kernels.configs import LinearConfig
from qlens.kernels.expert_sort import sort_by_expert
from qlens.kernels.experts import ExpertsPlan, stacked_experts
from qlens.kernels.grouped_experts import grouped_config, grouped_experts_linear
from qlens.modules import QuantExperts
from qlens.modules.hf_experts import expert_gate_of
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

# The experts' schemes timed: every grouped family, packed 4-bit words and one byte an element.
SCHEMES = (*PACKED_4BIT_SCHEMES, ("fp8-block", {}))
# (label, experts): Qwen3-MoE experts blocks, hidden 2048, moe_intermediate 768, top-8.
BLOCKS = (("Qwen3-30B-A3B-like, 64 experts", 64), ("Qwen3-30B-A3B, 128 experts", 128))
HIDDEN, INTERMEDIATE, TOP_K = 2048, 768, 8
# batched_mm is left out: it gathers one weight matrix per routed row (77 GB at 8192 rows).
BF16_IMPLEMENTATIONS = ("eager", "grouped_mm")
# (block_m, block_n, block_k, num_warps, num_stages) of the grouped launch, for --sweep.
SWEEP = (
    (64, 64, 256, 4, 3),
    (64, 64, 128, 4, 3),
    (64, 64, 128, 8, 4),
    (64, 128, 128, 8, 3),
    (128, 64, 128, 8, 3),
    (32, 64, 128, 8, 3),
)
TIMING = "eager calls, CUDA events around each, median of 10 after 3 warm-up calls"


def time_eager(call) -> float:
    """Microseconds of ``call``, or NaN (with the error printed) when it cannot run here."""
    try:
        return _time_eager(call)
    except (*LAUNCH_ERRORS, TypeError, NotImplementedError) as err:
        print(f"<!-- failed: {str(err)[:300]} -->", flush=True)
        return float("nan")


def bf16_block(experts: int) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=experts,
        num_experts_per_tok=TOP_K,
        hidden_act="silu",
    )
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    return block.to("cuda", torch.bfloat16).eval()


def quant_block(block: torch.nn.Module, scheme: str, options: dict) -> QuantExperts:
    gate = expert_gate_of(block)
    if isinstance(gate, str):
        raise RuntimeError(f"qlens cannot read Qwen3MoeExperts: {gate}")
    gate_up, down = (
        quantize_weight(p.detach(), scheme, **options)
        for p in (block.gate_up_proj, block.down_proj)
    )
    return QuantExperts(gate_up, down, gate)


def reference_block(block: torch.nn.Module, experts: QuantExperts) -> torch.nn.Module:
    """The HF block in float32 on ``experts``' dequantized weights, its loop implementation."""
    ref = copy.deepcopy(block).float()
    ref.config._experts_implementation = "eager"
    weights = dequantize(experts)
    with torch.no_grad():
        ref.gate_up_proj.copy_(weights["gate_up_proj"])
        ref.down_proj.copy_(weights["down_proj"])
    return ref


def route_of(experts: QuantExperts, hidden: torch.Tensor, rows: int) -> str:
    """The launch the gate_up projection takes for ``rows`` rows of ``hidden``'s dtype."""
    plan = experts.experts_plan("gate_up", hidden)
    if not plan.one_launch(rows):
        return "expert by expert"
    return "DecodedExperts" if plan.decoded(rows, hidden.dtype) else "GroupedExperts"


def scheme_row(label, scheme, options, block, hidden, index, weights, t_bf16) -> str:
    experts = quant_block(block, scheme, options)
    with torch.no_grad():
        t_qlens = time_eager(lambda: experts(hidden, index, weights))
        route = route_of(experts, hidden, index.numel())
        out = experts(hidden, index, weights)
        expected = reference_block(block, experts)(hidden.float(), index, weights.float())
        min_rows = experts_module.DECODED_EXPERTS_MIN_ROWS_PER_EXPERT
        experts_module.DECODED_EXPERTS_MIN_ROWS_PER_EXPERT = 1 << 62  # qlens' grouped kernel
        experts.forget_prepared()
        try:
            t_grouped = time_eager(lambda: experts(hidden, index, weights))
        finally:
            experts_module.DECODED_EXPERTS_MIN_ROWS_PER_EXPERT = min_rows
            experts.forget_prepared()
        original = ExpertsPlan.one_launch
        ExpertsPlan.one_launch = lambda self, rows: False  # each used expert on its rows
        try:
            t_loop = time_eager(lambda: experts(hidden, index, weights))
        finally:
            ExpertsPlan.one_launch = original
    best = min((t for t in t_bf16.values() if not math.isnan(t)), default=float("nan"))
    bf16_cells = " | ".join(f"{t_bf16[name]:.0f}" for name in BF16_IMPLEMENTATIONS)
    return (
        f"| {label} | {scheme} | {route} | {t_qlens:.0f} | {t_grouped:.0f} | {t_loop:.0f} | "
        f"{bf16_cells} | {t_qlens / best:.2f}x | {t_grouped / best:.2f}x | "
        f"{rel_err(out, expected):.1e} |"
    )


def bf16_times(block, hidden, index, weights) -> dict[str, float]:
    """Microseconds of the bf16 block under each experts implementation."""
    times = {}
    with torch.no_grad():
        for name in BF16_IMPLEMENTATIONS:
            block.config._experts_implementation = name
            times[name] = time_eager(lambda: block(hidden, index, weights))
    return times


def block_rows(label: str, num_experts: int, tokens: int, schemes, gen) -> list[str]:
    """One row per scheme for one experts block."""
    block = bf16_block(num_experts)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).cuda().to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, generator=gen).cuda()
    weights, index = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    weights = weights.to(torch.bfloat16)
    t_bf16 = bf16_times(block, hidden, index, weights)
    rows = []
    for scheme, options in select_schemes(SCHEMES, schemes):
        rows.append(scheme_row(label, scheme, options, block, hidden, index, weights, t_bf16))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def time_configs(x, view, num_experts: int, configs: list[LinearConfig]) -> list[float]:
    """Microseconds of the grouped call on ``x`` under each configuration, then of its work
    besides the launch."""
    w, experts = view
    return [
        time_eager(lambda cfg=cfg: grouped_experts_linear(x, w, experts, num_experts, None, cfg))
        for cfg in configs
    ] + [time_eager(lambda: routing(x, experts.ids, num_experts, w.packed))]


def routing(x, ids, num_experts: int, packed: bool) -> None:
    """The grouped call's work besides its launch: sorting the rows, regrouping ``x`` (packed
    4-bit words only)."""
    sort_by_expert(ids, num_experts)
    if packed:
        permute_codes(x)


def sweep_rows(num_experts: int, tokens: int, schemes, gen) -> list[str]:
    """The grouped launch alone on both projections of a block, per tile configuration."""
    logits = torch.randn(tokens, num_experts, generator=gen).cuda()
    ids = logits.topk(TOP_K, dim=-1).indices.reshape(-1)
    rows = []
    for projection, n, k in (("gate_up", 2 * INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE)):
        weight = torch.randn(num_experts, n, k, generator=gen).cuda() * 0.02
        x = torch.randn(ids.numel(), k, generator=gen).cuda().to(torch.bfloat16)
        swept = [
            LinearConfig("gemm", bm, bn, bk, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in SWEEP
        ]
        for scheme, options in select_schemes(SCHEMES, schemes):
            view = stacked_experts(quantize_weight(weight, scheme, **options), ids)
            if view is None:
                raise RuntimeError(f"{scheme}: the grouped GEMM cannot read these experts")
            default = grouped_config(ids.numel(), num_experts, n, packed=view[0].packed)
            cells = time_configs(x, view, num_experts, [default, *swept])
            rows.append(
                f"| {projection} ({num_experts} x {n} x {k}) | {scheme} | "
                + " | ".join(f"{t:.0f}" for t in cells)
                + " |"
            )
            print(rows[-1], flush=True)
    return rows


def _config_label(cfg: LinearConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--schemes", help="comma-separated subset of int4,mxfp4,nvfp4,fp8-block")
    parser.add_argument("--sweep", action="store_true", help="also time grouped launch tiles")
    args = parser.parse_args()
    out = [
        header(f"qlens MoE prefill: routed quantized experts of {args.tokens} tokens", TIMING),
        "One experts block (gate_up, activation, down, weighted sum) per row; times in us. "
        "`qlens` is the library's choice (its route: `DecodedExperts` decodes every expert, "
        "then `torch._grouped_mm`; `GroupedExperts` is qlens' grouped kernel); `Triton "
        "grouped` forces the grouped kernel. `vs best bf16` is a time over the fastest bf16 "
        "implementation's (lower is faster; the target is at most 1.2x).",
        "",
        "| block | scheme | qlens route | qlens us | Triton grouped us | expert by expert us | "
        + " | ".join(f"bf16 {name} us" for name in BF16_IMPLEMENTATIONS)
        + " | qlens vs best bf16 | Triton grouped vs best bf16 | rel. error |",
        "|---|---|---|---|---|---|" + "---|" * len(BF16_IMPLEMENTATIONS) + "---|---|---|",
    ]
    gen = torch.Generator().manual_seed(0)
    for label, num_experts in BLOCKS:
        out += block_rows(label, num_experts, args.tokens, args.schemes, gen)
    if args.sweep:
        packed = grouped_config(args.tokens * TOP_K, BLOCKS[0][1], HIDDEN)
        byte = grouped_config(args.tokens * TOP_K, BLOCKS[0][1], HIDDEN, packed=False)
        labels = [f"default ({_config_label(packed)}; fp8: {_config_label(byte)})"] + [
            _config_label(LinearConfig("gemm", bm, bn, bk, num_warps=w, num_stages=st))
            for bm, bn, bk, w, st in SWEEP
        ]
        out += [
            "",
            "Grouped calls alone (us; block_m x block_n x block_k, warps, stages), and the "
            "part of each call besides its launch (sorting the rows, regrouping x for 4-bit):",
            "",
            "| projection | scheme | " + " | ".join(labels) + " | sort and regroup |",
            "|---|---|" + "---|" * (len(labels) + 1),
        ]
        out += sweep_rows(BLOCKS[0][1], args.tokens, args.schemes, gen)
    publish("\n".join(out), "moe_prefill_h200.md")


if __name__ == "__main__":
    main()
