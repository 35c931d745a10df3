"""Dequantize kernels vs eager torch and torch.compile, as a share of copy bandwidth.

Run on a CUDA GPU: ``python benchmarks/dequant.py [--sweep] [--only int4]``; prints markdown (and
writes it to ``$OUT/dequant.md`` when ``$OUT`` is set). Bandwidth counts the packed bytes read
(data, scales, zeros) plus the bf16 bytes written. Peers: the codec in eager torch, the codec under
``torch.compile`` (which graph-breaks on its input validation), and for fp8-block and int4 the bare
arithmetic written for ``torch.compile`` (no validation), the strongest torch baseline. ``--sweep``
times every tile of ``SWEEP`` per scheme and reports the best. The copy ceiling is the fastest of
three device copies measured in the same run (``timing.copy_bandwidths``).
"""

from __future__ import annotations

import argparse
from typing import no_type_check

import torch
import triton
import triton.language as tl
from _timing import (
    ONE_CALL_TIMING,
    copy_bandwidths,
    header,
    publish,
    seeded_weight,
    time_graph,
    time_or_nan,
)

from qlens.kernels import dequantize_triton
from qlens.kernels.dequant import GPU_DEQUANT_LAUNCH, DequantLaunch
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

SCHEMES = (
    ("fp8-block", {}),
    ("fp8-block", {"scale_dtype": "e8m0"}),
    ("mxfp8", {}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 128, "asymmetric": True}),
    ("int8", {"group_size": 128}),
)
SHAPE = (28672, 8192)
SWEEP = tuple(
    DequantLaunch(*t)
    for t in (
        (32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 512, 8), (16, 1024, 4), (128, 128, 4),
        (64, 256, 8), (128, 256, 8), (32, 1024, 8), (16, 512, 2), (16, 2048, 8), (32, 2048, 8),
    )
)  # fmt: skip


def fp8_block_plain(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """128 x 128 block-scaled FP8 to bf16 in bare torch (shapes multiples of 128)."""
    n, k = data.shape
    blocks = data.float().view(n // 128, 128, k // 128, 128) * scales[:, None, :, None]
    return blocks.view(n, k).to(torch.bfloat16)


def int4_plain(data: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Symmetric group-wise int4 (low nibble first, offset 8) to bf16 in bare torch."""
    n = data.shape[0]
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).view(n, -1).float() - 8.0
    k = codes.shape[1]
    return (codes.view(n, k // group, group) * scales[:, :, None]).view(n, k).to(torch.bfloat16)


PLAIN = {("fp8-block", ()): fp8_block_plain, ("int4", (("group_size", 128),)): int4_plain}


def best_tile(p, nbytes: int) -> tuple[DequantLaunch, float, list[str]]:
    """The fastest tile of ``SWEEP`` for payload ``p`` and a line per tile tried."""
    lines, best = [], (GPU_DEQUANT_LAUNCH, float("inf"))
    for tile in SWEEP:
        t = time_or_nan(lambda p=p, tile=tile: dequantize_triton(p, torch.bfloat16, launch=tile))
        lines.append(f"{tile.block_n}x{tile.block_k} w{tile.num_warps}: {t:.1f} us "
                     f"({nbytes / t / 1e6:.2f} TB/s)")  # fmt: skip
        if t < best[1]:
            best = (tile, t)
    return best[0], best[1], lines


@triton.jit
@no_type_check
def _expand_kernel(src_ptr, dst_ptr, OUT_PER_BYTE: tl.constexpr, BLOCK: tl.constexpr):
    """Each byte read becomes ``OUT_PER_BYTE`` bf16 values written: a dequantize's traffic with
    no decode, addressed in the output's own layout (repeated byte addresses, served by L1)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(src_ptr + offs // OUT_PER_BYTE)
    tl.store(dst_ptr + offs, byte.to(tl.float32).to(tl.bfloat16))


@triton.jit
@no_type_check
def _expand_join_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    """The 1:4 expansion with wide byte loads, each byte's value written twice (``tl.join``, as
    the packed dequantize kernel interleaves its even and odd codes)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(src_ptr + offs).to(tl.float32).to(tl.bfloat16)
    out_offs = tl.program_id(0) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(dst_ptr + out_offs, tl.reshape(tl.join(value, value), (2 * BLOCK,)))


def expand_ceilings(nbytes_out: int = 1 << 30) -> dict[str, float]:
    """TB/s (bytes read plus written) of pure byte-to-bf16 expansions, 1:4 (a 4-bit weight to
    bf16, two ways) and 1:2 (8-bit): the dequantize kernels' traffic without their arithmetic."""
    dst = torch.empty(nbytes_out // 2, dtype=torch.bfloat16, device="cuda")
    block = 4096
    src4 = torch.randint(0, 256, (dst.numel() // 2,), dtype=torch.uint8, device="cuda")
    src2 = torch.randint(0, 256, (dst.numel(),), dtype=torch.uint8, device="cuda")
    runs = {
        "expand 1:4": (src4, lambda: _expand_kernel[(dst.numel() // block,)](src4, dst, 2, block)),
        "expand 1:4 (join)": (
            src4,
            lambda: _expand_join_kernel[(src4.numel() // block,)](src4, dst, block),
        ),
        "expand 1:2": (src2, lambda: _expand_kernel[(dst.numel() // block,)](src2, dst, 1, block)),
    }
    return {
        name: (src.numel() + nbytes_out) / time_graph([call] * 4) / 1e6
        for name, (src, call) in runs.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every tile of SWEEP")
    parser.add_argument("--only", default="", help="time only schemes whose name contains this")
    args = parser.parse_args()
    copies = copy_bandwidths()
    copy_tbs = max(copies.values())
    out = [
        header("qlens dequantize kernels", ONE_CALL_TIMING),
        "- copy bandwidth (read + write), the ceiling below is the fastest: "
        + ", ".join(f"{name} {tbs:.2f} TB/s" for name, tbs in copies.items())
        + f"; shape {SHAPE[0]} x {SHAPE[1]} -> bf16",
        "- the same traffic without arithmetic (byte -> bf16 expansion, Triton): "
        + ", ".join(f"{name} {tbs:.2f} TB/s" for name, tbs in expand_ceilings().items()),
        "",
        f"| scheme | bytes in+out (MB) | Triton us ({GPU_DEQUANT_LAUNCH.block_n}x"
        f"{GPU_DEQUANT_LAUNCH.block_k} w{GPU_DEQUANT_LAUNCH.num_warps}) | TB/s | % of copy | "
        "best swept tile | its us | its % of copy | eager us | torch.compile (codec) us | "
        "torch.compile (bare math) us | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sweeps = []
    w = seeded_weight(*SHAPE)
    compiled = torch.compile(dequantize, dynamic=False)
    for scheme, kw in SCHEMES:
        name = scheme + (" " + ",".join(f"{a}={b}" for a, b in kw.items()) if kw else "")
        if args.only not in name:
            continue
        p = quantize_weight(w, scheme, **kw)
        nbytes = p.nbytes + w.numel() * 2
        exact = torch.equal(dequantize_triton(p, torch.bfloat16), dequantize(p, torch.bfloat16))
        t = time_or_nan(lambda p=p: dequantize_triton(p, torch.bfloat16))
        eager = time_or_nan(lambda p=p: dequantize(p, torch.bfloat16), graph=False)
        comp = time_or_nan(lambda p=p: compiled(p, torch.bfloat16), graph=False)
        plain_fn = PLAIN.get((scheme, tuple(kw.items())))
        bare = float("nan")
        if plain_fn is not None:
            plain = torch.compile(plain_fn, dynamic=False)
            exact = exact and torch.equal(plain(p.data, p.scales), dequantize(p, torch.bfloat16))
            bare = time_or_nan(lambda p=p, f=plain: f(p.data, p.scales))
        tbs = nbytes / t / 1e6
        best, best_t = GPU_DEQUANT_LAUNCH, t
        if args.sweep:
            best, best_t, lines = best_tile(p, nbytes)
            sweeps.append(f"- {name}: " + "; ".join(lines))
        best_tbs = nbytes / best_t / 1e6
        out.append(
            f"| {name} | {nbytes / 1e6:.0f} | {t:.1f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% | "
            f"{best.block_n}x{best.block_k} w{best.num_warps} | {best_t:.1f} | "
            f"{100 * best_tbs / copy_tbs:.0f}% | {eager:.1f} | {comp:.1f} | {bare:.1f} | {exact} |"
        )
        print(out[-1], flush=True)
    if sweeps:
        out += ["", "## Tile sweep", "", *sweeps]
    again = ", ".join(f"{name} {tbs:.2f} TB/s" for name, tbs in copy_bandwidths().items())
    out.append(f"\n- copy bandwidth re-measured at the end: {again}")
    publish("\n".join(out), "dequant.md")


if __name__ == "__main__":
    main()
