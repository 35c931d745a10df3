"""Host time the bridge adds to each generated token: plain HF ``generate`` against
``bridge.generate`` with no hooks, one steering hook, and a hook on every layer.

Eager decode is host-bound on a GPU (bf16 8B decodes at about 48 tok/s on the H200 while its
weights stream in 3.3 ms a token), so what the bridge costs at decode is the Python it runs
per token. This measures that Python directly: a Llama with the 8B shape's 32 layers but a
tiny width, on the CPU, where the matmuls cost next to nothing and the per-token path (HF's
generate loop, the decoder layers, the bridge's hook points) is the same Python that runs on a
GPU. A GPU run times the same thing plus the kernels' launches.

Timing: this thread's CPU time (torch on one thread) of whole ``generate`` calls; every round
runs each variant once, back to back, and a variant's ratio is the median over rounds of its
time over plain HF's in the same round (robust to a shared CPU whose speed drifts).

Run: ``python benchmarks/bridge_decode_host.py`` (prints markdown; with ``$OUT`` set, also
writes ``$OUT/bridge_decode_host_cpu.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

# Python puts this script's folder first on sys.path, where kernels.py would shadow the
# `kernels` package transformers probes for; put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402

from benchmarks._timing import header, publish  # noqa: E402

PROMPT_TOKENS = 8


def build(layers: int, device: torch.device):
    """A random-weight Llama with ``layers`` layers of width 64 (SDPA), and its bridge."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import qlens

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device).eval()
    model.generation_config.eos_token_id = None
    return model, qlens.load(model)


def variants(model, bridge, new_tokens: int) -> dict[str, Callable[[], object]]:
    """Each way of generating ``new_tokens`` greedy tokens after the same prompt."""
    device = next(model.parameters()).device
    prompt = torch.randint(0, 256, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    mask = torch.ones_like(prompt)
    layers = bridge.cfg.n_layers
    direction = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(2))
    direction = direction.to(device)
    kept: list[torch.Tensor] = []

    def steer(resid: torch.Tensor, hook: object) -> torch.Tensor:
        return resid + direction

    def keep(resid: torch.Tensor, hook: object) -> None:
        kept.append(resid)

    def hf() -> object:
        return model.generate(
            input_ids=prompt, attention_mask=mask, pad_token_id=0, max_new_tokens=new_tokens,
            do_sample=False,
        )  # fmt: skip

    def through_bridge(hooks: list) -> Callable[[], object]:
        def run() -> object:
            kept.clear()
            with bridge.hooks(fwd_hooks=hooks):
                return bridge.generate(
                    prompt, return_type="tokens", max_new_tokens=new_tokens, do_sample=False
                )

        return run

    every = [(f"blocks.{i}.hook_resid_post", keep) for i in range(layers)]
    return {
        "plain HF generate": hf,
        "bridge, no hooks": through_bridge([]),
        "bridge, one steering hook": through_bridge(
            [(f"blocks.{layers // 2}.hook_resid_post", steer)]
        ),
        "bridge, a reading hook on every layer": through_bridge(every),
    }


def measure(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of this thread's CPU time per call, ``rounds`` interleaved rounds."""
    for run in runs.values():  # warm: caches, allocator pools
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.thread_time()
            run()
            times[name].append(time.thread_time() - start)
    return times


def table(times: dict[str, list[float]], new_tokens: int) -> list[str]:
    base = times["plain HF generate"]
    lines = [
        "| variant | host ms a generate | host us a token | vs plain HF (median of pairs) |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        ratio = statistics.median(t / b for t, b in zip(values, base, strict=True))
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median * 1e3:.1f} | {median / new_tokens * 1e6:.0f} | {ratio:.3f}x |"
        )
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (8B: 32)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens a generate")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--gpu", action="store_true", help="run on the GPU (default: CPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.gpu else "cpu")
    torch.set_num_threads(1)
    model, bridge = build(args.layers, device)
    with torch.no_grad():
        times = measure(variants(model, bridge, args.tokens), args.rounds)
    timing = (
        f"this thread's CPU time of whole generate calls ({args.tokens} greedy tokens after an "
        f"{PROMPT_TOKENS}-token prompt, batch 1), {args.rounds} interleaved rounds after two "
        f"warm-up calls each; a Llama of {args.layers} layers, width 64, SDPA, on {device}"
    )
    text = "\n".join(
        [header("Host time the bridge adds at decode", timing, ["transformers"])]
        + table(times, args.tokens)
    )
    publish(text, f"bridge_decode_host_{device.type}.md")
    return text


if __name__ == "__main__":
    main()
