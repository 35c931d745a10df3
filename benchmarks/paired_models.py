"""bf16 and quantized copies of one model, all resident, timed in interleaved rounds.

A drifting host moves every model of a round alike, so the ratios taken within each round
(this model's time or speed against bf16's in the same round) are steadier than ratios of
medians taken minutes apart. Each round runs every model once, in rotated order:

- prefill: one plain HF forward of ``--prefill-tokens`` tokens (no cache);
- decode: eager HF ``generate``, ``--decode-tokens`` greedy tokens after a 32-token prompt.

Also counted, once per model: the GPU operations (kernels, copies, fills) of one eager decode
step (torch profiler): their launches set the step's host time when it is host-bound. Models are the random-weight shapes of
``e2e_model.py`` (``_e2e_models``), quantized with ``qlens.quantize(model, scheme)``.

Run on a CUDA GPU: ``python benchmarks/paired_models.py --size 8b --schemes int4,nvfp4``
(``--size moe`` for the Qwen3-30B-A3B-like MoE); prints markdown and, when ``$OUT`` is set,
writes it to ``$OUT/paired_models_<size>_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

# Python puts this script's folder first on sys.path, where kernels.py would shadow the
# `kernels` package transformers probes for; put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._e2e_models import build_model, shapes, weight_gib  # noqa: E402
from benchmarks._timing import header, median_wall_s, publish  # noqa: E402

PROMPT_TOKENS = 32
TIMING = (
    "wall clock, synchronized around each run; every round runs each model once (order rotated "
    "by one each round) after one untimed round; the ratios are medians over rounds of each "
    "round's ratio against bf16"
)


def gpu_ops_per_step(model: nn.Module, prompt: torch.Tensor) -> int | str:
    """GPU operations (kernels, copies, fills) of one eager decode step (one token against a
    32-token cache); ``"-"`` without a GPU."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return "-"
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        step = lambda: model(token, past_key_values=out.past_key_values, use_cache=True)  # noqa: E731
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("1b", "8b", "moe"), default="8b")
    parser.add_argument("--schemes", default="int4,nvfp4,mxfp4,fp8-block")
    parser.add_argument("--prefill-tokens", type=int, help="default 2048 (MoE 1024)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="tiny models, CPU allowed")
    args = parser.parse_args()
    import qlens

    shape = shapes(args.tiny, args.prefill_tokens)[args.size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = build_model(shape, device)
    models = {"bf16": base}
    for scheme in args.schemes.split(","):
        models[scheme] = qlens.quantize(base, scheme)
    gen = torch.Generator().manual_seed(0)
    vocab = shape.config["vocab_size"]
    tokens = torch.randint(0, vocab, (1, shape.prefill_tokens), generator=gen).to(device)
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(device)
    mask = torch.ones_like(prompt)

    def prefill(model: nn.Module) -> Callable[[], object]:
        return lambda: model(input_ids=tokens, use_cache=False)

    def decode(model: nn.Module) -> Callable[[], object]:
        return lambda: model.generate(
            input_ids=prompt, attention_mask=mask, pad_token_id=0, do_sample=False,
            max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
        )  # fmt: skip

    names = list(models)
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in names}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):  # the first round warms up, untimed
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                model = models[name]
                for kind, call in (("prefill", prefill(model)), ("decode", decode(model))):
                    seconds = median_wall_s(call, repeats=1, warmup=0)
                    if round_:
                        times[name][kind].append(seconds)
            print(f"<!-- round {round_} done -->", flush=True)

    def paired(name: str, kind: str) -> float:
        ratios = [m / b for m, b in zip(times[name][kind], times["bf16"][kind], strict=True)]
        return statistics.median(ratios)

    rows = [
        "| model | weights GiB | prefill ms | prefill time vs bf16, paired | decode tok/s | "
        "decode speed vs bf16, paired | GPU ops a decode step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        model = models[name]
        prefill_ms = statistics.median(times[name]["prefill"]) * 1e3
        decode_tps = args.decode_tokens / statistics.median(times[name]["decode"])
        rows.append(
            f"| {name} | {weight_gib(model):.2f} | {prefill_ms:.1f} | "
            f"{paired(name, 'prefill'):.3f}x | {decode_tps:.1f} | "
            f"{1 / paired(name, 'decode'):.3f}x | {gpu_ops_per_step(model, prompt)} |"
        )
    title = f"Paired rounds: {shape.label}, prefill {shape.prefill_tokens} tokens, decode "
    title += f"{args.decode_tokens} tokens"
    publish(header(title, TIMING) + "\n".join(rows), f"paired_models_{args.size}_h200.md")


if __name__ == "__main__":
    main()
