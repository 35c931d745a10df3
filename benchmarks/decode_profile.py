"""Where an eager decode step spends its host time: cProfile of greedy ``generate`` on a
random-weight Llama, bf16 against qlens schemes, plus the CUDA kernels launched per token.

Run on a GPU: ``python benchmarks/decode_profile.py [--size 1b] [--schemes int4,fp8-block]``.
Prints, per model, the wall time per token, the kernels per token (torch profiler) and the
functions with the most own time under cProfile (which slows every Python call alike).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from _e2e_models import build_model, shapes

import qlens


def generate(model, prompt: torch.Tensor, tokens: int) -> None:
    mask = torch.ones_like(prompt)
    model.generate(
        input_ids=prompt, attention_mask=mask, pad_token_id=0, max_new_tokens=tokens,
        do_sample=False,
    )  # fmt: skip


def profile_model(model, prompt: torch.Tensor, tokens: int, top: int) -> str:
    generate(model, prompt, tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate(model, prompt, tokens)
    torch.cuda.synchronize()
    per_token_ms = (time.perf_counter() - start) / tokens * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        generate(model, prompt, tokens)
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages()) / tokens
    profiler = cProfile.Profile()
    profiler.enable()
    generate(model, prompt, tokens)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return (
        f"wall {per_token_ms:.2f} ms/token, GPU kernel time {gpu_us / 1e3:.2f} ms/token, "
        f"{kernels / tokens:.0f} kernels/token\n" + text.getvalue()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1b", choices=("1b", "8b", "moe"))
    parser.add_argument("--schemes", default="int4,fp8-block")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    shape = shapes(False, None)[args.size]
    device = torch.device("cuda")
    prompt = torch.randint(0, 1000, (1, 32), device=device)
    for scheme in ["bf16", *args.schemes.split(",")]:
        model = build_model(shape, device)
        if scheme != "bf16":
            model = qlens.quantize(model, scheme, inplace=True)
        print(f"## {shape.label}, {scheme}\n", profile_model(model, prompt, args.tokens, args.top))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
