"""MoE decode: one token's routed experts, packed 4-bit, against bf16 experts run one by one.

For each experts projection (``[experts, n, k]``, ``top_k`` experts routed for one token) this
times, as CUDA-graph replays over fresh routes and enough weight copies to exceed the L2 cache:

- qlens one launch: ``experts_gemv``, each of the ``top_k`` rows reading its own expert;
- qlens expert by expert: ``quantized_linear`` once per routed expert (the only path before
  the one-launch path existed; larger batches now take the grouped GEMM, ``moe_prefill.py``);
- bf16 expert by expert: ``F.linear`` per routed expert on bf16 weights, as an eager HF experts
  loop runs them.

It also times ``experts_linear`` eagerly (as a model calls it: id range check on the host, then
the launch) next to the bf16 loop run eagerly, and checks each qlens result against the
dequantized weights in float64.

Run on a CUDA GPU: ``python benchmarks/moe_decode.py``; prints markdown and, when ``$OUT`` is
set, writes it to ``$OUT/moe_decode_<gpu>.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _timing import (
    PACKED_4BIT_SCHEMES,
    clone_payload,
    copies_for,
    header,
    publish,
    rel_err,
    time_eager,
    time_graph,
)

from qlens.kernels import experts_linear, quantized_linear
from qlens.kernels.configs import choose_config
from qlens.kernels.experts import stacked_experts
from qlens.kernels.gemv import experts_gemv
from qlens.quant.dequantize import dequantize
from qlens.quant.expert_payloads import select_expert
from qlens.quant.quantize import quantize_weight

# (name, experts, n, k, top_k): one projection of each model's experts, one token routed.
PROJECTIONS = (
    ("Mixtral-8x7B w1", 8, 14336, 4096, 2),
    ("Mixtral-8x7B w2", 8, 4096, 14336, 2),
    ("Qwen3-30B-A3B gate_up", 128, 1536, 2048, 8),
    ("Qwen3-30B-A3B down", 128, 2048, 768, 8),
    ("GPT-OSS-20B gate_up", 32, 5760, 2880, 4),
    ("GPT-OSS-20B down", 32, 2880, 2880, 4),
)
ROUTES = 8  # distinct routes per graph, so that the same experts are not re-read from L2


def _routes(experts: int, top_k: int, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randperm(experts, generator=gen)[:top_k].cuda() for _ in range(count)]


def _bf16_loop(x: torch.Tensor, w: torch.Tensor, route: list[int]):
    return lambda: [F.linear(x[i : i + 1], w[e]) for i, e in enumerate(route)]


def _expert_loop(x: torch.Tensor, p, route: list[int]):
    return lambda: [
        quantized_linear(x[i : i + 1], select_expert(p, e)) for i, e in enumerate(route)
    ]


def _one_launch(x: torch.Tensor, view, cfg):
    return lambda: experts_gemv(x, view[0], view[1], None, cfg)


def _scheme_row(label, scheme, kwargs, w, x, routes, t_bf16, t_bf16_eager) -> str:
    experts, n, k = w.shape
    top_k = x.shape[0]
    p = quantize_weight(w, scheme, **kwargs).to("cuda")
    copies = copies_for(p.nbytes * top_k // experts * ROUTES)
    ps = [p] + [clone_payload(p) for _ in range(copies - 1)]
    cfg = choose_config(1, n, k, x.device, packed_words=True)
    views = [stacked_experts(q, r) for q in ps for r in routes]
    if any(v is None for v in views):
        raise RuntimeError(f"{scheme} {label}: no one-launch view")
    t_one = time_graph([_one_launch(x, v, cfg) for v in views])
    t_loop = time_graph([_expert_loop(x, q, r.tolist()) for q in ps for r in routes])
    t_eager = time_eager(lambda: experts_linear(x, p, routes[0]))
    ref = torch.einsum("tk,tnk->tn", x.double(), dequantize(p, torch.float64)[routes[0]])
    err = rel_err(experts_linear(x, p, routes[0]), ref)
    return (
        f"| {label} | {scheme} | {t_one:.1f} | {t_loop:.1f} | {t_bf16:.1f} | "
        f"{t_bf16 / t_one:.2f}x | {t_loop / t_one:.2f}x | {t_eager:.1f} | {t_bf16_eager:.1f} | "
        f"{err:.1e} |"
    )


def main() -> None:
    out = [
        header("qlens MoE decode: routed 4-bit experts of one token"),
        "Ratios are bf16 expert-by-expert time over qlens time (higher is faster). The eager "
        "columns include launch overhead and, for qlens, the host check of the expert ids.",
        "",
        "| projection (experts x n x k, top-k) | scheme | one launch us | expert by expert us | "
        "bf16 loop us | one launch vs bf16 | one launch vs expert by expert | eager "
        "experts_linear us | eager bf16 loop us | rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    gen = torch.Generator().manual_seed(0)
    for name, experts, n, k, top_k in PROJECTIONS:
        w = torch.randn(experts, n, k, generator=gen).to(torch.bfloat16) * 0.02
        w_gpu = w.cuda()
        x = torch.randn(top_k, k, generator=gen).cuda().to(torch.bfloat16)
        routes = _routes(experts, top_k, ROUTES, gen)
        t_bf16 = time_graph([_bf16_loop(x, w_gpu, r.tolist()) for r in routes])
        t_bf16_eager = time_eager(_bf16_loop(x, w_gpu, routes[0].tolist()))
        label = f"{name} ({experts} x {n} x {k}, {top_k})"
        for scheme, kwargs in PACKED_4BIT_SCHEMES:
            out.append(_scheme_row(label, scheme, kwargs, w, x, routes, t_bf16, t_bf16_eager))
            print(out[-1], flush=True)
            torch.cuda.empty_cache()
    publish("\n".join(out), "moe_decode_h200.md")


if __name__ == "__main__":
    main()
