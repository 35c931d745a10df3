"""What does the bridge cost over a plain Hugging Face forward?

Variants, each timed in the same process as its own plain-HF baseline:
  plain HF forward (use_cache=False, as the bridges run it) | bridge, no hooks | run_with_cache of the residual stream
  (hook_resid_pre/mid/post) | run_with_cache of every hook point,
for qlens' Bridge and, when a Python with `transformer-lens` is given, TransformerLens'
TransformerBridge on the same weights.

CPU mode (default): the embedded SmolLM2-135M in fp32, 1 thread, 128 and 512 tokens:
    python benchmarks/bridge_overhead.py [--tl-python /tmp/tlvenv/bin/python]
GPU mode: random-weight bf16 Llamas of ~1B and ~8B shape at 2048 tokens (no network needed):
    python benchmarks/bridge_overhead.py --gpu [--tl-python python3]

Prints a markdown table (medians of --repeats timed runs after --warmup runs; the variants are
interleaved within each repeat so that load drift hits all of them alike). On the CPU the ratios
use the process's CPU time, which other jobs sharing the machine disturb far less than wall time;
on the GPU they use wall time. CPU mode also reports the kernel (system) share of that CPU time and
the minor page faults, i.e. the cost of handing the process fresh memory for what a cache keeps.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# Python puts this script's folder first on sys.path; other benchmark scripts there (kernels.py)
# would shadow installed packages of the same name that transformers probes for. Put the
# repository root there instead, so qlens imports without being installed.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402

RESIDUAL_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")
TARGETS = {"no hooks": 1.03, "cache residual stream": 1.10, "cache everything": 1.15}
# Llama shapes with random bf16 weights for the GPU mode (Llama-3.2-1B and Llama-3.1-8B sizes).
GPU_SHAPES = {
    "llama-1B-shape": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama-8B-shape": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


@dataclass
class Timing:
    library: str
    model: str
    tokens: int
    variant: str
    wall_s: float  # median wall time
    cpu_s: float  # median CPU time of this process
    wall_runs: list[float]
    cpu_runs: list[float]
    sys_s: float = 0.0  # median kernel share of the CPU time (page faults for fresh memory)
    faults: float = 0.0  # median minor page faults per run


def is_residual_hook(name: str) -> bool:
    return name.endswith(RESIDUAL_HOOKS)


Runs = tuple[list[float], list[float], list[float], list[float]]


def time_interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, warmup: int, sync: Callable[[], None]
) -> dict[str, Runs]:
    """Run every variant `warmup` times, then `repeats` rounds of one timed call each.

    Returns, per variant, the wall times, process CPU times, kernel CPU times and minor page
    faults of the timed calls.
    """
    for _ in range(warmup):
        for run in variants.values():
            run()
            sync()
    runs: dict[str, Runs] = {name: ([], [], [], []) for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            sync()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            sync()
            runs[name][0].append(time.perf_counter() - wall)
            runs[name][1].append(time.process_time() - cpu)
            after = resource.getrusage(resource.RUSAGE_SELF)
            runs[name][2].append(after.ru_stime - usage.ru_stime)
            runs[name][3].append(after.ru_minflt - usage.ru_minflt)
    return runs


def qlens_variants(plain_model, bridged_model, tokens) -> dict[str, Callable[[], object]]:
    from qlens import Bridge

    return same_work(plain_model, Bridge(bridged_model), tokens)


def same_work(plain_model, bridge, tokens) -> dict[str, Callable[[], object]]:
    """The four variants, for any bridge with ``__call__`` and ``run_with_cache(names_filter=)``."""
    return {
        "plain HF": lambda: plain_model(input_ids=tokens, use_cache=False),
        "no hooks": lambda: bridge(tokens),
        "cache residual stream": lambda: bridge.run_with_cache(
            tokens, names_filter=is_residual_hook
        ),
        "cache everything": lambda: bridge.run_with_cache(tokens),
    }


def stand_in_checkpoint(config, vocab_size: int) -> tuple[str, object]:
    """A directory holding ``config`` and a word-level tokenizer of ``vocab_size`` words, for
    loaders that need a checkpoint name (TransformerLens) around a random-weight model."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"<unk>": vocab_size - 2}
    vocab["[UNK]"] = vocab_size - 1
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="w1", eos_token="w0"
    )
    directory = tempfile.mkdtemp(prefix="qlens-bench-")
    config.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory, AutoTokenizer.from_pretrained(directory)


def transformer_lens_variants(plain_model, bridged_model, tokens, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    name = bridged_model.name_or_path
    if not name:  # a random-weight model: TransformerLens still wants a checkpoint to name
        name, tokenizer = stand_in_checkpoint(bridged_model.config, bridged_model.config.vocab_size)
    bridge = TransformerBridge.boot_transformers(
        name,
        hf_model=bridged_model,
        tokenizer=tokenizer,
        device=str(tokens.device),
        dtype=bridged_model.dtype,
    )
    return same_work(plain_model, bridge, tokens)


def load_pair(model_dir: str, dtype: torch.dtype, device: str):
    """Two independent copies of one checkpoint: one stays plain, one gets wrapped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def one():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    return one(), one(), AutoTokenizer.from_pretrained(model_dir)


def random_pair(shape: dict, device: str):
    """Two identical random-weight bf16 Llamas of the given shape on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            # Separate config objects: a library that edits its model's config (TransformerLens
            # forces eager attention) must not change the plain baseline's attention too.
            plain = LlamaForCausalLM(copy.deepcopy(config)).eval()
            bridged = LlamaForCausalLM(copy.deepcopy(config)).eval()
            bridged.load_state_dict(plain.state_dict())
    finally:
        torch.set_default_dtype(previous)
    return plain, bridged


def measure(
    library: str, model_name: str, plain, bridged, tokenizer, args, device: str
) -> list[Timing]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    timings = []
    generator = torch.Generator().manual_seed(0)
    for length in args.tokens:
        high = min(10_000, plain.config.vocab_size)
        tokens = torch.randint(0, high, (1, length), generator=generator).to(device)
        if library == "qlens":
            variants = qlens_variants(plain, bridged, tokens)
        else:
            variants = transformer_lens_variants(plain, bridged, tokens, tokenizer)
        with torch.no_grad():
            runs = time_interleaved(variants, args.repeats, args.warmup, sync)
        for variant, (wall, cpu, kernel, faults) in runs.items():
            timings.append(
                Timing(
                    library,
                    model_name,
                    length,
                    variant,
                    statistics.median(wall),
                    statistics.median(cpu),
                    wall,
                    cpu,
                    statistics.median(kernel),
                    statistics.median(faults),
                )
            )
        del variants
    return timings


def run_worker(args) -> list[Timing]:
    """Time one library in this process."""
    if args.gpu:
        timings = []
        for name, shape in GPU_SHAPES.items():
            plain, bridged = random_pair(shape, "cuda")
            timings += measure(args.worker, name, plain, bridged, None, args, "cuda")
            del plain, bridged
            torch.cuda.empty_cache()
        return timings
    plain, bridged, tokenizer = load_pair(args.model_dir, torch.float32, "cpu")
    return measure(args.worker, "SmolLM2-135M fp32", plain, bridged, tokenizer, args, "cpu")


def run_transformer_lens(args) -> tuple[list[Timing], str]:
    """Time TransformerLens in its own interpreter (its pins may conflict with qlens')."""
    command = [args.tl_python, os.path.abspath(__file__), "--worker", "transformer-lens"]
    command += ["--model-dir", str(args.model_dir), "--tokens", *map(str, args.tokens)]
    command += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    command += ["--threads", str(args.threads)] + (["--gpu"] if args.gpu else [])
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        return [], f"TransformerLens skipped: its worker failed:\n{tail}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    version = json.loads(lines[0])["transformer_lens"]
    return [Timing(**json.loads(line)) for line in lines[1:]], f"transformer-lens {version}"


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            name = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def render(timings: list[Timing], args, notes: list[str]) -> str:
    import transformers

    import qlens

    clock = "wall_s" if args.gpu else "cpu_s"
    baseline = {
        (t.library, t.model, t.tokens): getattr(t, clock)
        for t in timings
        if t.variant == "plain HF"
    }
    lines = [
        "# Bridge overhead",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- hardware: {hardware()}; torch threads: {torch.get_num_threads()}",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, qlens {qlens.__version__}",
        f"- command: `{' '.join(['python', *sys.argv])}`",
        f"- medians of {args.repeats} interleaved runs after {args.warmup} warmups, batch 1; "
        f"ratio = median {'wall' if args.gpu else 'CPU'} time / the same for the plain HF "
        "forward timed in the same process",
        *[f"- {note}" for note in notes],
        "",
        "| library | model | tokens | variant | wall ms | CPU ms | kernel ms | minor faults "
        "| ratio vs plain HF | target |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in timings:
        ratio = getattr(t, clock) / baseline[(t.library, t.model, t.tokens)]
        target = (
            f"≤ {TARGETS[t.variant]:.2f}×" if t.library == "qlens" and t.variant in TARGETS else ""
        )
        lines.append(
            f"| {t.library} | {t.model} | {t.tokens} | {t.variant} | {t.wall_s * 1e3:.1f} "
            f"| {t.cpu_s * 1e3:.1f} | {t.sys_s * 1e3:.1f} | {t.faults:.0f} | {ratio:.3f}× "
            f"| {target} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="random bf16 ~1B/~8B Llamas on CUDA")
    parser.add_argument("--tokens", type=int, nargs="+", help="sequence lengths (batch 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU mode)")
    parser.add_argument(
        "--tl-python",
        help="Python interpreter with transformer-lens installed; omit to skip TransformerLens",
    )
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--worker", default="qlens", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = [2048] if args.gpu else [128, 512]
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device; none is visible to torch.")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker == "transformer-lens":
        from importlib.metadata import version

        print(json.dumps({"transformer_lens": version("transformer-lens")}))
        for timing in run_worker(args):
            print(json.dumps(timing.__dict__))
        return
    notes = []
    if not args.gpu:
        from qlens.models import default_model_dir

        args.model_dir = str(default_model_dir())
        notes.append(
            "the CPU is shared with other jobs, so absolute times are noisy; compare ratios"
        )
    timings = run_worker(args)
    if args.tl_python:
        tl_timings, note = run_transformer_lens(args)
        timings += tl_timings
        notes.append(note)
    else:
        notes.append("TransformerLens not measured (pass --tl-python)")
    table = render(timings, args, notes)
    print(table)
    if args.out:
        with open(args.out, "w") as out:
            out.write(table)


if __name__ == "__main__":
    main()
