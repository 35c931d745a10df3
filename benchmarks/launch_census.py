"""Kernel launches of one eager decode step, per decoder layer, for bf16 and each qlens scheme.

Eager decode is host-bound (``results/decode_host_h200.md``: host time equals wall time), so
each launch a token costs host time whatever the kernel does. This counts them without a GPU:
one decoder layer of the real shape (Llama-3.2-1B, Llama-3.1-8B, a Qwen3-30B-A3B-like MoE) runs
a one-token step on the CPU with qlens' kernel route and the H200 launch tables forced, every
Triton launch recorded by kernel name instead of run, and every ATen op recorded by a dispatch
mode; ops that only make views or allocate launch nothing and are not counted.

Run: ``TRITON_INTERPRET=1 python benchmarks/launch_census.py`` (prints markdown; with ``$OUT`` set, also writes
``$OUT/launch_census_cpu.md``). Takes about a minute (quantizing the layers).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

# Python puts this script's folder first on sys.path, where kernels.py would shadow the
# `kernels` package transformers probes for; put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks._e2e_models import LLAMA_1B, LLAMA_8B, QWEN3_MOE  # noqa: E402
from benchmarks._timing import header, publish  # noqa: E402

# ATen ops that make views, change metadata or allocate: no kernel launch.
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "slice", "select", "alias", "expand", "as_strided", "split", "split_with_sizes", "unbind",
    "empty", "empty_like", "empty_strided", "detach", "lift_fresh", "_to_copy_noop",
}  # fmt: skip
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B, "moe": QWEN3_MOE}
SCHEMES = ("bf16", "int4", "nvfp4", "mxfp4", "fp8-block", "fp8-block-w8a8")


class AtenLaunches(TorchDispatchMode):
    """Counts the ATen ops that launch a kernel, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class Recorded:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the kernel's name."""

    def __init__(self, name: str, launches: collections.Counter[str]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            self.launches[self.name] += 1

        return launch


def force_h200_kernel_route(launches: collections.Counter[str]) -> None:
    """The kernel route on CPU tensors with the H200's launch tables; Triton launches recorded."""
    import qlens.kernels.configs as configs
    import qlens.kernels.dequant as dequant
    import qlens.kernels.fp8_w8a8 as fp8_w8a8
    import qlens.kernels.gemv as gemv
    import qlens.kernels.grouped_experts as grouped
    import qlens.kernels.moe_decode as moe_decode
    import qlens.kernels.plan as plan
    import qlens.kernels.sibling_gemv as sibling_gemv
    import qlens.kernels.splits as splits
    import qlens.kernels.weight_only as weight_only
    from qlens.kernels.experts import ExpertsPlan
    from qlens.kernels.fast_launch import FastLaunch

    plan.choose_route = lambda payload, device: ("kernel", None)
    ExpertsPlan.one_launch = lambda self, rows: True
    plan_init = ExpertsPlan.__init__

    def accelerated(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        plan_init(self, *args, **kwargs)
        self._accelerated = True  # the CPU's plans take the expert loop otherwise

    ExpertsPlan.__init__ = accelerated
    configs.interpreting = lambda: False
    configs.gpu_name = lambda device: "NVIDIA H200"
    configs.sm_count = lambda device: 132
    for module in (gemv, sibling_gemv, splits, grouped, fp8_w8a8, dequant, weight_only, moe_decode):
        for name, value in list(vars(module).items()):
            if isinstance(value, FastLaunch):
                kernel_name = getattr(value.kernel, "__name__", name).strip("_")
                setattr(module, name, FastLaunch(Recorded(kernel_name, launches)))


def decoder_layer(shape: dict, scheme: str):
    """One decoder layer of ``shape`` (random weights, float32 on the CPU), quantized with
    ``scheme`` unless bf16, and its rotary embedding."""
    from transformers import LlamaConfig, Qwen3MoeConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeRotaryEmbedding,
    )

    import qlens

    moe = "num_experts" in shape
    config_class, layer_class, rotary_class = (
        (Qwen3MoeConfig, Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding)
        if moe
        else (LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding)
    )
    config = config_class(**{**shape, "num_hidden_layers": 1})
    config._attn_implementation = "sdpa"
    if moe:  # what the model-level constructors choose, and the e2e models run
        config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    layer = layer_class(config, layer_idx=0).eval()
    if scheme == "fp8-block-w8a8":  # block FP8 with FP8 activations, as e2e_model.py's row
        layer = qlens.quantize(layer, "fp8-block")
        qlens.set_w8a8(layer)
    elif scheme != "bf16":
        layer = qlens.quantize(layer, scheme)  # the default skips, as the e2e models
    return layer, rotary_class(config), config


def census(shape: dict, scheme: str, launches: collections.Counter[str]) -> dict[str, int]:
    """Launches of one one-token step through one layer, after a warm-up step."""
    from transformers import DynamicCache

    layer, rotary, config = decoder_layer(shape, scheme)
    hidden = config.hidden_size
    cache = DynamicCache(config=config)
    counts: dict[str, int] = {}
    with torch.no_grad():
        for step, tokens in enumerate((8, 1, 1)):
            x = torch.randn(1, tokens, hidden)
            position = torch.arange(step * 8, step * 8 + tokens)[None]
            embeddings = rotary(x, position)
            launches.clear()
            with AtenLaunches() as aten:
                layer(x, position_embeddings=embeddings, past_key_values=cache, use_cache=True)
            if step == 2:  # a decode step whose launches are all prepared
                counts = {
                    "triton": sum(launches.values()),
                    "reductions": launches.get("reduce_splits_kernel", 0),
                    "aten": sum(aten.ops.values()),
                    "mm": aten.ops.get("mm", 0) + aten.ops.get("addmm", 0)
                    + aten.ops.get("_grouped_mm", 0) + aten.ops.get("bmm", 0),
                }  # fmt: skip
                counts["kernels"] = ", ".join(f"{k} {v}" for k, v in sorted(launches.items()))
    return counts


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    launches: collections.Counter[str] = collections.Counter()
    force_h200_kernel_route(launches)
    lines = [
        "| shape | scheme | launches a layer | vs bf16 | Triton launches | of them split "
        "reductions | ATen launches | of them matmuls | Triton kernels |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in args.sizes:
        base = None
        for scheme in SCHEMES:
            c = census(SHAPES[size], scheme, launches)
            total = c["triton"] + c["aten"]
            base = base or total
            lines.append(
                f"| {size} | {scheme} | {total} | {total / base:.2f}x | {c['triton']} | "
                f"{c['reductions']} | {c['aten']} | {c['mm']} | {c['kernels'] or '-'} |"
            )
            print(lines[-1], flush=True)
    timing = (
        "counts, not times: one decoder layer of each shape, a one-token decode step after an "
        "8-token prefill and one warm-up step, on the CPU with qlens' kernel route and the "
        "H200 launch tables forced; Triton launches recorded, not run; ATen ops that only "
        "make views or allocate not counted"
    )
    text = header("Kernel launches of an eager decode step, per layer", timing, ["transformers"])
    text += "\n".join(lines)
    publish(text, "launch_census_cpu.md")
    return text


if __name__ == "__main__":
    main()
