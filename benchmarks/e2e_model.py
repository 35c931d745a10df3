"""Whole models the way users run them: bf16 against every qlens scheme and bitsandbytes.

Random-weight bf16 models (SDPA attention) of Llama-3.2-1B and Llama-3.1-8B shape and one
Qwen3-30B-A3B-like MoE (24 layers, 64 experts, top-8), built on the GPU; each qlens scheme
quantizes the bf16 model with ``qlens.quantize(model, scheme)``, and bitsandbytes NF4 and
LLM.int8 (when ``import bitsandbytes`` works) swap its linears for bitsandbytes' own modules, as
transformers' loader does; ``bnb-nf4-qlens`` and ``bnb-int8-qlens`` are those models with their
modules rerouted through qlens' kernels (``qlens.reroute_quantized_modules(model, force=True)``).
Everything runs in one process, bf16 first. Per model:

- weights: GiB of parameters and buffers (bitsandbytes: with their quantization states);
- prefill: one forward of ``--prefill-tokens`` tokens through ``qlens.load(model)``;
- cache: ``run_with_cache`` of every ``hook_resid_post`` at that length (x bf16 prefill);
- decode: eager ``bridge.generate``, ``--decode-tokens`` greedy tokens after a 32-token prompt,
  without hooks and with one steering hook adding a vector to ``blocks.{L/2}.hook_resid_post``;
- plain HF forward and ``generate`` of the same model, for the bridge's overhead;
- compiled decode: transformers' static-cache ``generate`` with a ``CompileConfig``, and
  ``qlens.StaticDecoder`` (the whole step in one CUDA graph, the host reading the device every
  16 tokens) (``--compile-schemes``; each compile takes tens of seconds); with
  ``--static-hooks``, ``StaticDecoder`` over the bridge with the steering hook and recording
  every ``hook_resid_post``;
- ratios against bf16 and against bitsandbytes NF4.

Every measurement is isolated: a failure (a compile that breaks, memory) is written into its
cell and the run goes on. Timings are medians of ``--repeats`` wall-clock runs after a warm-up,
synchronized around each run.

Run on a CUDA GPU, one size per invocation (each sized to stay well inside 10 minutes on an
H200, the three together about 8 minutes, much of it compiling; trim with the options below):
    python benchmarks/e2e_model.py --sizes 1b --out e2e_model_1b.md
    python benchmarks/e2e_model.py --sizes 8b --out e2e_model_8b.md
    python benchmarks/e2e_model.py --sizes moe --out e2e_model_moe.md
Options: ``--schemes int4,nvfp4,bnb-nf4`` (a subset; bf16 always runs), ``--skip-compile``,
``--compile-schemes all``. On a CPU, ``--tiny`` runs tiny models of the same families end to
end through the CPU reference path (compiled with the eager backend).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

# Python puts this script's folder first on sys.path, where kernels.py would shadow the
# `kernels` package transformers probes for; put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._e2e_models import Shape, bnb_quantized, build_model, shapes, weight_gib  # noqa: E402
from benchmarks._timing import header, median_wall_s, publish, select_schemes  # noqa: E402

PROMPT_TOKENS = 32
BNB_SCHEMES = ("bnb-nf4", "bnb-int8")
# bitsandbytes models with their modules rerouted through qlens' kernels
# (``reroute_quantized_modules(force=True)``), by the bitsandbytes row they start from.
BNB_REROUTED = {"bnb-nf4-qlens": "bnb-nf4", "bnb-int8-qlens": "bnb-int8"}
# qlens rows beyond the quantize schemes: block FP8 with FP8 activations (``qlens.set_w8a8``).
W8A8_SCHEME = "fp8-block-w8a8"
DEFAULT_COMPILE = ("bf16", "int4", "bnb-nf4")


def error_cell(err: BaseException) -> str:
    """A failed measurement's table cell: the error's type and first line."""
    first = (str(err).strip().splitlines() or [""])[0][:160]
    return f"error: {type(err).__name__}: {first}".replace("|", "\\|")


@dataclass
class Row:
    """One model's measurements: seconds, tokens per second, GiB, or an error's text."""

    scheme: str
    cells: dict[str, float | str] = field(default_factory=dict)

    def measure(self, key: str, run: Callable[[], float]) -> None:
        """Store ``run()`` under ``key``, or the error it raised; print progress."""
        try:
            self.cells[key] = run()
        except Exception as err:  # noqa: BLE001 - a failure fills its cell, the run goes on
            self.cells[key] = error_cell(err)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(f"<!-- {self.scheme} {key}: {self.cells[key]} -->", flush=True)


@dataclass(frozen=True)
class Workload:
    """What every model runs: the prefill tokens, the prompt, the decode length and repeats."""

    tokens: torch.Tensor
    prompt: torch.Tensor
    decode_tokens: int
    repeats: int
    compile_backend: str
    static_hooks: bool = False  # also time StaticDecoder steered and recording


def decode_call(
    generate: Callable[..., torch.Tensor], work: Workload, new_tokens: int, **kwargs
) -> Callable[[], None]:
    """A greedy ``generate`` of ``new_tokens`` tokens after the prompt, checked to have produced
    them all."""

    def run() -> None:
        out = generate(work.prompt, max_new_tokens=new_tokens, do_sample=False, **kwargs)
        expected = work.prompt.shape[1] + new_tokens
        if out.shape[1] != expected:
            raise RuntimeError(f"generate returned {out.shape[1]} tokens, not {expected}")

    return run


def tokens_per_s(
    generate: Callable[..., torch.Tensor], work: Workload, compiled: bool = False, **kwargs
) -> float:
    """Decode tokens per second of ``generate``: the median of ``work.repeats`` calls after
    warm-up calls of full length (one eager, which grows the caches and the allocator's pool to
    the timed length; compiled: two, which compile and record the CUDA graphs for the static
    cache of that length)."""
    full = decode_call(generate, work, work.decode_tokens, **kwargs)
    for _ in range(2 if compiled else 1):
        full()
    return work.decode_tokens / median_wall_s(full, work.repeats, warmup=0)


def hf_generate(model: nn.Module) -> Callable[..., torch.Tensor]:
    def generate(prompt: torch.Tensor, **kwargs) -> torch.Tensor:
        mask = torch.ones_like(prompt)
        return model.generate(input_ids=prompt, attention_mask=mask, pad_token_id=0, **kwargs)

    return generate


def measure_plain(row: Row, model: nn.Module, work: Workload, compiled: bool) -> None:
    """The plain HF model: forward, eager ``generate`` and, when ``compiled``, the static-cache
    compiled ``generate`` (compiled state dropped afterwards)."""
    row.measure(
        "hf_prefill_s",
        lambda: median_wall_s(lambda: model(input_ids=work.tokens, use_cache=False), work.repeats),
    )
    row.measure("hf_decode", lambda: tokens_per_s(hf_generate(model), work))
    if compiled:
        row.measure("compiled_decode", lambda: compiled_tokens_per_s(model, work))
        forget_compiled(model)
        row.measure(
            "static_decode",
            lambda: tokens_per_s(static_decoder_generate(model, work), work, compiled=True),
        )
        forget_compiled(model)


def paired_time_ratio(
    top_run: Callable[[], None], bottom_run: Callable[[], None], repeats: int
) -> float:
    """``top_run``'s time over ``bottom_run``'s, as the median over ``repeats`` back-to-back
    pairs (each run synchronized): a host whose speed drifts slows both sides of a pair alike,
    where two separate medians minutes apart can differ by tens of percent."""

    def timed(call: Callable[[], None]) -> float:
        return median_wall_s(call, repeats=1, warmup=0)

    top_run()
    bottom_run()  # both warm
    ratios = sorted(timed(top_run) / timed(bottom_run) for _ in range(repeats))
    return ratios[len(ratios) // 2]


def measure_paired(row: Row, model: nn.Module, base: nn.Module, work: Workload) -> None:
    """Plain HF prefill and eager decode of ``model`` against bf16 ``base``, paired."""

    def prefill(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            m(input_ids=work.tokens, use_cache=False)

        return run

    row.measure(
        "paired_prefill", lambda: paired_time_ratio(prefill(base), prefill(model), work.repeats)
    )
    row.measure(
        "paired_decode",
        lambda: paired_time_ratio(
            decode_call(hf_generate(base), work, work.decode_tokens),
            decode_call(hf_generate(model), work, work.decode_tokens),
            work.repeats,
        ),
    )


def compiled_generate_kwargs(work: Workload) -> dict:
    """``generate`` arguments of transformers' compiled static-cache decode: inductor with CUDA
    graphs (``reduce-overhead``) on a GPU, ``work.compile_backend`` elsewhere."""
    from transformers import CompileConfig

    if work.compile_backend == "inductor":
        config = CompileConfig(fullgraph=False, mode="reduce-overhead")
    else:
        config = CompileConfig(fullgraph=False, backend=work.compile_backend, mode="default")
        config._compile_all_devices = True  # transformers compiles on the GPU only otherwise
    return {"cache_implementation": "static", "compile_config": config}


def compiled_tokens_per_s(model: nn.Module, work: Workload) -> float:
    return tokens_per_s(hf_generate(model), work, True, **compiled_generate_kwargs(work))


def static_decoder(model_or_bridge, work: Workload, fuse_siblings: bool = True):
    """A ``qlens.StaticDecoder`` whose cache fits the workload's prompt and decode, compiled
    with its backend (CUDA graphs on a GPU)."""
    from qlens.static_decode import StaticDecoder

    length = work.prompt.shape[1] + work.decode_tokens
    return StaticDecoder(
        model_or_bridge, length, backend=work.compile_backend, fuse_siblings=fuse_siblings
    )


def static_decoder_generate(
    model: nn.Module, work: Workload, fuse_siblings: bool = True
) -> Callable[..., torch.Tensor]:
    """``qlens.StaticDecoder``'s compiled decode (the host reading the device every 16 tokens)
    as a ``generate`` that always produces ``max_new_tokens``."""
    decoder = static_decoder(model, work, fuse_siblings)

    def generate(prompt: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        return decoder.generate(prompt, max_new_tokens, stop_at_eos=False)

    return generate


def forget_compiled(model: nn.Module) -> None:
    """Drop what a compiled ``generate`` left behind (its graphs, its static cache)."""
    torch._dynamo.reset()
    for name in ("_compiled_call", "_cache"):
        if name in vars(model):
            delattr(model, name)
    free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def for_each_quantized(
    base: nn.Module, schemes: list[str], run: Callable[[str, nn.Module], None]
) -> None:
    """``run(scheme, qlens.quantize(base, scheme))`` for each scheme, one quantized model at a
    time: each is freed before the next is built."""
    import qlens

    for scheme in schemes:
        model = qlens.quantize(base, scheme)
        run(scheme, model)
        del model
        free_memory()


def measure_bridge(row: Row, model: nn.Module, work: Workload, compiled: bool) -> None:
    """Through ``qlens.load(model)``: prefill, ``run_with_cache`` of every ``hook_resid_post``,
    eager decode without hooks and with one steering hook (and, when ``compiled`` and
    ``work.static_hooks``, ``StaticDecoder``'s steered and recording decode)."""
    import qlens

    bridge = qlens.load(model)
    row.measure("prefill_s", lambda: median_wall_s(lambda: bridge(work.tokens), work.repeats))
    row.measure(
        "cache_s",
        lambda: median_wall_s(
            lambda: bridge.run_with_cache(
                work.tokens, names_filter=lambda name: name.endswith("hook_resid_post")
            ),
            work.repeats,
        ),
    )
    row.measure(
        "paired_cache",
        lambda: paired_time_ratio(
            lambda: bridge.run_with_cache(
                work.tokens, names_filter=lambda name: name.endswith("hook_resid_post")
            ),
            lambda: bridge(work.tokens),
            work.repeats,
        ),
    )
    generate = bridge_generate(bridge)
    row.measure("decode", lambda: tokens_per_s(generate, work))
    row.measure(
        "paired_bridge_decode",
        lambda: paired_time_ratio(
            decode_call(generate, work, work.decode_tokens),
            decode_call(hf_generate(model), work, work.decode_tokens),
            work.repeats,
        ),
    )
    layer = bridge.cfg.n_layers // 2
    direction = torch.randn(
        bridge.cfg.d_model,
        generator=torch.Generator().manual_seed(1),
    ).to(work.prompt.device, torch.bfloat16)

    def steer(resid: torch.Tensor, hook: object) -> torch.Tensor:
        return resid + direction

    hooks = [(f"blocks.{layer}.hook_resid_post", steer)]

    def steered() -> float:
        with bridge.hooks(fwd_hooks=hooks):
            return tokens_per_s(generate, work)

    row.measure("steered_decode", steered)
    plain_decode = decode_call(generate, work, work.decode_tokens)

    def steered_decode() -> None:
        with bridge.hooks(fwd_hooks=hooks):
            plain_decode()

    row.measure(
        "paired_steering",
        lambda: paired_time_ratio(steered_decode, plain_decode, work.repeats),
    )
    if compiled and work.static_hooks:
        measure_static_hooks(row, bridge, work, hooks)


def measure_static_hooks(row: Row, bridge, work: Workload, steering: list) -> None:
    """``qlens.StaticDecoder`` over the bridge: with the steering hook, and recording every
    ``hook_resid_post`` (``generate_with_cache``), compiled state dropped afterwards."""
    decoder = static_decoder(bridge, work)
    names = [name for name in bridge.hook_names if name.endswith("hook_resid_post")]

    def steered(prompt: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        with bridge.hooks(fwd_hooks=steering):
            return decoder.generate(prompt, max_new_tokens, stop_at_eos=False)

    def recording(prompt: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        return decoder.generate_with_cache(prompt, max_new_tokens, names, stop_at_eos=False)[0]

    row.measure("static_steered", lambda: tokens_per_s(steered, work, compiled=True))
    row.measure("static_recording", lambda: tokens_per_s(recording, work, compiled=True))
    forget_compiled(bridge.model)


def bridge_generate(bridge) -> Callable[..., torch.Tensor]:
    def generate(prompt: torch.Tensor, **kwargs) -> torch.Tensor:
        return bridge.generate(prompt, return_type="tokens", **kwargs)

    return generate


def measure_model(
    scheme: str,
    make: Callable[[], nn.Module],
    work: Workload,
    bridge: bool,
    compiled: bool,
    base: nn.Module | None = None,
) -> Row:
    """Build one model with ``make`` and measure it (against bf16 ``base`` in pairs too, when
    given); the model is freed afterwards."""
    row = Row(scheme)
    holder: list[nn.Module] = []

    def built() -> float:
        holder.append(make())
        return weight_gib(holder[0])

    row.measure("weights_gib", built)
    if holder:
        with torch.no_grad():
            if bridge:
                measure_bridge(row, holder[0], work, compiled)
            measure_plain(row, holder[0], work, compiled)
            if base is not None:
                measure_paired(row, holder[0], base, work)
    holder.clear()
    free_memory()
    return row


def maker(base: nn.Module, scheme: str) -> Callable[[], nn.Module]:
    """What builds the row ``scheme`` from the bf16 ``base``: bitsandbytes' modules,
    ``qlens.quantize``, or for ``W8A8_SCHEME`` block FP8 with ``qlens.set_w8a8``."""
    import qlens

    def make() -> nn.Module:
        if scheme in BNB_SCHEMES:
            return bnb_quantized(base, scheme)
        if scheme in BNB_REROUTED:
            model = bnb_quantized(base, BNB_REROUTED[scheme])
            qlens.reroute_quantized_modules(model, force=True)
            return model
        if scheme == W8A8_SCHEME:
            model = qlens.quantize(base, "fp8-block")
            qlens.set_w8a8(model)
            return model
        return qlens.quantize(base, scheme)

    return make


def measure_shape(shape: Shape, schemes: list[str], args, device: torch.device) -> list[Row]:
    """bf16 first, then each qlens scheme and each bitsandbytes peer, one model at a time."""

    vocab = shape.config["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    work = Workload(
        tokens=torch.randint(0, vocab, (1, shape.prefill_tokens), generator=gen).to(device),
        prompt=torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(device),
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        compile_backend="eager" if device.type == "cpu" else "inductor",
        static_hooks=args.static_hooks,
    )

    def compiles(scheme: str) -> bool:
        return not args.skip_compile and (
            args.compile_schemes == "all" or scheme in args.compile_schemes.split(",")
        )

    try:
        base = build_model(shape, device)
    except Exception as err:  # noqa: BLE001 - the other shapes still run
        free_memory()
        return [Row("bf16", {"weights_gib": error_cell(err)})]
    with torch.no_grad():  # warms the process up: its first timed decode ran slow otherwise
        for _ in range(2):
            decode_call(hf_generate(base), work, work.decode_tokens)()
    rows = [measure_model("bf16", lambda: base, work, True, compiles("bf16"))]
    for scheme in schemes:
        rows.append(
            measure_model(
                scheme, maker(base, scheme), work, scheme not in BNB_SCHEMES, compiles(scheme), base
            )
        )
    return rows


COLUMNS = (
    "scheme",
    "weights GiB",
    "memory vs bf16",
    "prefill ms",
    "prefill speed-up vs bf16",
    "cache resid_post ms",
    "cache / bf16 prefill",
    "decode tok/s",
    "decode vs bf16",
    "steered tok/s",
    "HF prefill ms",
    "HF decode tok/s",
    "bridge overhead prefill",
    "bridge overhead decode",
    "compiled tok/s",
    "compiled vs bf16",
    "StaticDecoder tok/s",
    "StaticDecoder vs bf16",
    "StaticDecoder steered tok/s",
    "StaticDecoder recording resid_post tok/s",
    "HF prefill vs NF4",
    "HF decode vs NF4",
    "HF prefill vs bf16, paired",
    "HF decode vs bf16, paired",
    "bridge overhead decode, paired",
    "cache / prefill, paired",
    "steering cost, paired",
)


def table(rows: list[Row]) -> list[str]:
    """Markdown rows: absolute numbers, then ratios (x > 1 is faster or smaller); a ratio is
    empty where one side is missing."""
    by_scheme = {row.scheme: row.cells for row in rows}
    bf16, nf4 = by_scheme.get("bf16", {}), by_scheme.get("bnb-nf4", {})

    def num(cells: dict, key: str) -> float | None:
        value = cells.get(key)
        return value if isinstance(value, float) else None

    def ratio(top: float | None, bottom: float | None) -> str:
        return f"{top / bottom:.2f}x" if top is not None and bottom else ""

    def shown(cells: dict, key: str, scale: float = 1.0, style: str = ".1f") -> str:
        value = cells.get(key)
        if isinstance(value, float):
            return format(value * scale, style)
        return value if isinstance(value, str) else "-"

    def paired(cells: dict, key: str) -> str:
        value = cells.get(key)
        if isinstance(value, float):
            return f"{value:.2f}x"
        return value if isinstance(value, str) else ""

    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for row in rows:
        c = row.cells
        cells = [
            row.scheme,
            shown(c, "weights_gib", style=".3g"),
            ratio(num(bf16, "weights_gib"), num(c, "weights_gib")),
            shown(c, "prefill_s", 1e3),
            ratio(num(bf16, "prefill_s"), num(c, "prefill_s")),
            shown(c, "cache_s", 1e3),
            ratio(num(c, "cache_s"), num(bf16, "prefill_s")),
            shown(c, "decode"),
            ratio(num(c, "decode"), num(bf16, "decode")),
            shown(c, "steered_decode"),
            shown(c, "hf_prefill_s", 1e3),
            shown(c, "hf_decode"),
            ratio(num(c, "prefill_s"), num(c, "hf_prefill_s")),
            ratio(num(c, "hf_decode"), num(c, "decode")),
            shown(c, "compiled_decode"),
            ratio(num(c, "compiled_decode"), num(bf16, "compiled_decode")),
            shown(c, "static_decode"),
            ratio(num(c, "static_decode"), num(bf16, "static_decode")),
            shown(c, "static_steered"),
            shown(c, "static_recording"),
            ratio(num(nf4, "hf_prefill_s"), num(c, "hf_prefill_s")),
            ratio(num(c, "hf_decode"), num(nf4, "hf_decode")),
            "1.00x" if row.scheme == "bf16" else paired(c, "paired_prefill"),
            "1.00x" if row.scheme == "bf16" else paired(c, "paired_decode"),
            paired(c, "paired_bridge_decode"),
            paired(c, "paired_cache"),
            paired(c, "paired_steering"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=("1b", "8b", "moe"), default=["1b"])
    parser.add_argument(
        "--schemes",
        help="comma-separated qlens schemes and bnb-nf4/bnb-int8 to run besides bf16 (default: "
        "every qlens scheme, and both bitsandbytes peers when bitsandbytes imports)",
    )
    parser.add_argument("--prefill-tokens", type=int, help="default 2048 (MoE 1024), tiny 16")
    parser.add_argument("--decode-tokens", type=int, help="greedy tokens; default 64, tiny 4")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement; default 3")
    parser.add_argument("--skip-compile", action="store_true", help="no compiled decode")
    parser.add_argument(
        "--compile-schemes",
        default=",".join(DEFAULT_COMPILE),
        help=f"rows whose compiled decode is timed, or 'all' (default {','.join(DEFAULT_COMPILE)})",
    )
    parser.add_argument(
        "--static-hooks",
        action="store_true",
        help="compiled rows also time StaticDecoder with the steering hook and recording every "
        "hook_resid_post (two more compiles a row)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models, CPU allowed")
    parser.add_argument("--out", help="also write the markdown to this file")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("full-size models need a CUDA GPU; on a CPU pass --tiny.")
    args.decode_tokens = args.decode_tokens or (4 if args.tiny else 64)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    return args


def available_schemes(names: str | None) -> list[str]:
    """qlens' schemes, then the bitsandbytes peers when ``bitsandbytes`` imports; filtered by
    ``--schemes``, whose unknown names are an error."""
    from qlens.modules.model_quantize import SCHEMES

    known = [*SCHEMES, W8A8_SCHEME, *BNB_SCHEMES, *BNB_REROUTED]
    if names is not None:
        unknown = sorted(set(names.split(",")) - set(known) - {"bf16"})
        if unknown:
            raise SystemExit(f"unknown --schemes {unknown}; choose from {', '.join(known)}")
    peers = [*BNB_SCHEMES, *BNB_REROUTED] if bnb_importable() else []
    if names is not None and not peers and set(names.split(",")) & {*BNB_SCHEMES, *BNB_REROUTED}:
        raise SystemExit("--schemes names bitsandbytes peers, but `import bitsandbytes` fails")
    chosen = select_schemes([(s, {}) for s in [*SCHEMES, W8A8_SCHEME, *peers]], names)
    return [scheme for scheme, _ in chosen]


def bnb_importable() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    schemes = available_schemes(args.schemes)
    libraries = ["transformers", *(["bitsandbytes"] if bnb_importable() else [])]
    out = [
        header(
            "End-to-end models through qlens: bf16, qlens schemes and bitsandbytes"
            + (" (tiny)" if args.tiny else ""),
            f"wall clock, synchronized around each run, median of {args.repeats} runs after a "
            f"warm-up; decode: {args.decode_tokens} greedy tokens after a {PROMPT_TOKENS}-token "
            "prompt, batch 1, tokens per second of the whole generate call",
            libraries,
        ),
        "Ratios: speed-ups are bf16 (or NF4) time / this row's time; `cache / bf16 prefill` is "
        "this row's run_with_cache time / bf16's plain bridge prefill; bridge overhead is the "
        "bridge's time / the plain HF model's time on the same model (1.00x = no cost). "
        "The paired columns time bf16 and this model back to back, alternating, and give the "
        "median of bf16's time / this model's over the pairs (robust to a host whose speed "
        "drifts during the run); the paired bridge overhead alternates the bridge's and the "
        "plain HF model's decode of the same model (its time over HF's), the paired cache "
        "the bridge's run_with_cache and its plain prefill (the cache's time over the "
        "prefill's), and the paired steering cost the bridge's decode with the steering hook "
        "and without (with over without). "
        "bitsandbytes rows run through plain HF only, and quantize `nn.Linear` layers only (the "
        "MoE's fused experts stay bf16). Cells starting with `error:` are "
        "measurements that failed.",
        "",
    ]
    for size in args.sizes:
        shape = shapes(args.tiny, args.prefill_tokens)[size]
        out += [f"## {shape.label}, prefill {shape.prefill_tokens} tokens", ""]
        out += table(measure_shape(shape, schemes, args, device))
        free_memory()  # the shape's bf16 model went with measure_shape
        out.append("")
        print("\n".join(out[-len(schemes) - 4 :]), flush=True)
    text = "\n".join(out)
    publish(text, f"e2e_model_{'_'.join(args.sizes)}.md")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
