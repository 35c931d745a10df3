"""Peak memory of quantize-on-load (`qlens.load(path, quantize=scheme)`) for a Llama-shaped model.

``python benchmarks/quantize_on_load.py`` loads Llama-3-8B shapes onto the CUDA GPU when there is
one, else onto the CPU; ``--size 1b`` (Llama-3.2-1B shapes, 512 MiB shards) fits a CPU machine
with a few GB free, ``--size tiny`` runs in seconds. Prints markdown (and writes it to
``$OUT/quantize_on_load_<cpu|h200>.md`` when ``$OUT`` is set). A random bf16 checkpoint is
written once to ``--dir`` (default: a temporary directory, deleted afterwards), shard by shard,
so the writer never holds the model whole. Each measurement runs in a fresh process, which
reports the peak GPU memory (``torch.cuda.max_memory_allocated``) and the peak host RSS
(``VmHWM``, reset after the imports) above its RSS after its imports. Targets: peak GPU <= 1.2 x
the quantized model's size; peak host <= the largest shard plus the quantized model.
``--compare`` also measures ``qlens.quantize(qlens.load(path))`` (the float model loaded whole).
On a machine with the memory, ``--dir /dev/shm/qlens-ckpt`` keeps the 8B checkpoint's 15 GiB
off the disk.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Python puts this script's folder first on sys.path, where kernels.py would shadow the
# `kernels` package transformers probes for; put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks._e2e_models import LLAMA_1B, LLAMA_8B  # noqa: E402
from benchmarks._timing import header, publish  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# Llama-3.2-1B's shapes with an untied lm_head, so both shapes hold an embedding and an lm_head
SHAPES = {"8b": LLAMA_8B, "1b": {**LLAMA_1B, "tie_word_embeddings": False}, "tiny": TINY}
SHARD_BYTES = {"8b": 5 * 2**30, "1b": 512 * 2**20, "tiny": 64 * 2**10}
GPU_TARGET = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="8b", help="model shapes")
    parser.add_argument("--tiny", action="store_true", help="same as --size tiny")
    parser.add_argument("--schemes", default="int4,mxfp4", help="comma-separated schemes")
    parser.add_argument("--dir", default=None, help="where the random checkpoint is written")
    parser.add_argument("--compare", action="store_true", help="also load, then quantize")
    parser.add_argument("--measure", nargs=3, metavar=("DIR", "SCHEME", "MODE"), help="internal")
    return parser.parse_args(argv)


def write_checkpoint(directory: Path, shape: dict, shard_bytes: int) -> None:
    """A random bf16 Llama checkpoint in safetensors shards, written one shard at a time (the
    values drawn on the GPU when there is one: drawing 8B bf16 values on the CPU takes minutes)."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, dtype="bfloat16")
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    draw_on = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(draw_on).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    size = 0
    for key, tensor_shape in shapes.items():
        numel = int(torch.Size(tensor_shape).numel())
        if shards[-1] and size + 2 * numel > shard_bytes:
            _save_shard(directory, shards, len(shards) - 1)
            shards.append({})
            size = 0
        values = torch.empty(tensor_shape, dtype=torch.bfloat16, device=draw_on)
        if "norm" in key:
            values.fill_(1.0)
        else:
            values.normal_(0.0, 0.02, generator=generator)
        shards[-1][key] = values.cpu()
        weight_map[key] = len(shards) - 1
        size += 2 * numel
    _save_shard(directory, shards, len(shards) - 1)
    total = len(shards)
    names = {i: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)}
    for i in range(total):
        (directory / f"shard-{i}.safetensors").rename(directory / names[i])
    index = {
        "metadata": {"total_size": sum(2 * torch.Size(s).numel() for s in shapes.values())},
        "weight_map": {k: names[i] for k, i in weight_map.items()},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(directory)


def _save_shard(directory: Path, shards: list[dict[str, torch.Tensor]], i: int) -> None:
    save_file(shards[i], str(directory / f"shard-{i}.safetensors"), metadata={"format": "pt"})
    shards[i] = {}  # free the written shard's tensors


def _reset_rss_peak() -> bool:
    """Reset this process' peak RSS (``VmHWM``) to its current RSS; False where Linux cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _rss_peak_bytes() -> int:
    """Peak RSS since the last reset: ``VmHWM`` (KiB), else ``ru_maxrss`` (process lifetime)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(directory: str, scheme: str, mode: str) -> dict:
    """Load ``directory`` quantized with ``scheme`` (``stream`` or ``after``) in this process."""
    import qlens

    # Import what loading imports before taking the baseline: peaks are the load's own memory.
    for name in ("qlens.loading", "qlens.quantize_on_load", "qlens.modules.model_quantize"):
        importlib.import_module(name)
    importlib.import_module(
        f"transformers.models.{json.loads(Path(directory, 'config.json').read_text())['model_type']}"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    baseline = _current_rss_bytes()
    reset = _reset_rss_peak()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if mode == "stream":
        bridge = qlens.load(directory, quantize=scheme, dtype=torch.bfloat16, device=device)
    else:
        bridge = qlens.quantize(
            qlens.load(directory, dtype=torch.bfloat16, device=device), scheme, inplace=True
        )
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(bridge.model)
    }
    return {
        "seconds": seconds,
        "model_bytes": sum(storages.values()),
        "gpu_peak": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "host_peak": _rss_peak_bytes() - baseline,
        "host_peak_since": "after imports" if reset else "process start",
    }


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.state_dict().values(), *(b for _, b in model.named_buffers())]


def _run_measure(directory: Path, scheme: str, mode: str) -> dict:
    command = [sys.executable, __file__, "--measure", str(directory), scheme, mode]
    # A fresh process per measurement, importing this checkout's qlens: peaks are its own.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {scheme} ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _host_memory() -> str:
    try:
        meminfo = Path("/proc/meminfo").read_text().split()
    except OSError:
        return "unknown"
    return f"{int(meminfo[meminfo.index('MemTotal:') + 1]) / 2**20:.0f} GiB"


def report(directory: Path, schemes: list[str], compare: bool, label: str) -> str:
    shard = max(p.stat().st_size for p in directory.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    title = f"qlens quantize-on-load peak memory, {label} (bf16 checkpoint)"
    timing = "wall-clock seconds of the load, each row measured in a fresh process"
    lines = [
        header(title, timing, libraries=("transformers", "safetensors", "accelerate")).rstrip(),
        f"- host memory: {_host_memory()}",
        f"- checkpoint: {_mib(total)} MiB in {len(list(directory.glob('*.safetensors')))} "
        f"shards, largest shard {_mib(shard)} MiB",
        "- stream: `qlens.load(path, quantize=scheme)`; after: `qlens.quantize(qlens.load(path), "
        "scheme, inplace=True)`; peak host: the highest RSS above the RSS after imports",
        "",
        "| scheme | mode | seconds | quantized model MiB | peak GPU MiB | GPU / model "
        "| peak host MiB | host <= shard + model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scheme in schemes:
        for mode in ("stream", "after") if compare else ("stream",):
            m = _run_measure(directory, scheme, mode)
            ratio = "n/a" if m["gpu_peak"] is None else f"{m['gpu_peak'] / m['model_bytes']:.2f}x"
            if m["gpu_peak"] is not None and mode == "stream":
                ratio += " ok" if m["gpu_peak"] <= GPU_TARGET * m["model_bytes"] else " OVER"
            host_ok = m["host_peak"] <= shard + m["model_bytes"]
            since = "" if m["host_peak_since"] == "after imports" else " (since start)"
            lines.append(
                f"| {scheme} | {mode} | {m['seconds']:.1f} | {_mib(m['model_bytes'])} | "
                f"{_mib(m['gpu_peak'])} | {ratio} | {_mib(m['host_peak'])}{since} | "
                f"{'yes' if host_ok else 'NO'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return ""
    size = "tiny" if args.tiny else args.size
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(args.dir or scratch) / f"random-llama-{size}"
        if not (directory / "config.json").is_file():
            write_checkpoint(directory, SHAPES[size], SHARD_BYTES[size])
        schemes = [s for s in args.schemes.split(",") if s]
        text = report(directory, schemes, args.compare, f"Llama {size} shapes")
    publish(text, "quantize_on_load_h200.md")  # named after the GPU that ran it, or "cpu"
    return text


if __name__ == "__main__":
    main()
