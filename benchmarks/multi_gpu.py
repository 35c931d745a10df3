"""A model split over several GPUs behaves exactly like the same model on one GPU.

Checks, on a random-weight Llama saved once as safetensors (no network needed):
  1. split with ``device_map="auto"`` over every GPU vs the same checkpoint on ``cuda:0``:
     logits, every cached activation (``run_with_cache(names_filter=None)``) and a patched
     forward (zero-ablating the last layer's attention output) are equal; max abs diff reported;
  2. ``quantize(model, "mxfp4")`` / ``"fp8-block"`` in place on the split model: the quantized
     modules run on every GPU of the split, and the logits match the same scheme on one GPU;
  3. ``torchrun --nproc-per-node <GPUs> -m qlens.distributed.harvest``: the union of the ranks'
     shards equals a single-process harvest.

Prints a markdown report (date, GPUs, versions, command); exit status 1 if a check fails.

    python benchmarks/multi_gpu.py                 # needs >= 2 GPUs
    python benchmarks/multi_gpu.py --cpu-simulate  # the same logic on CPU: the "split" is a
                                                   # CPU/disk-offload device map, torchrun uses Gloo
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Python puts this script's folder first on sys.path; other benchmark scripts there (kernels.py)
# would shadow installed packages of the same name that transformers probes for.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import torch  # noqa: E402

SCHEMES = ("mxfp4", "fp8-block")
HARVEST_NAMES = "blocks.*.hook_resid_post"
PATCHED = "hook_attn_out"  # zero-ablated in the last layer
SHAPES = {
    "gpu": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "cpu": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}


@dataclass
class Check:
    what: str
    passed: bool
    detail: str


@dataclass
class Setup:
    simulate: bool
    dtype: torch.dtype
    n_devices: int  # GPUs in the split (simulation: 2 torchrun ranks)
    model_dir: Path
    work: Path

    def single(self):
        from qlens.loading import load

        device = "cpu" if self.simulate else "cuda:0"
        return load(self.model_dir, dtype=self.dtype, device=device)

    def split(self, offload: bool = True):
        """The checkpoint split over the GPUs (simulation: CPU layers + disk-offloaded layers;
        without ``offload`` every layer stays on the CPU, for quantization)."""
        from qlens.loading import load

        if not self.simulate:
            return load(self.model_dir, dtype=self.dtype, device_map="auto")
        n = SHAPES["cpu"]["num_hidden_layers"]
        layers = {
            f"model.layers.{i}": "disk" if offload and i >= n // 2 else "cpu" for i in range(n)
        }
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", **layers}
        device_map.update({"model.norm": "cpu", "lm_head": "cpu"})
        offload_dir = tempfile.mkdtemp(dir=self.work, prefix="offload-")
        return load(
            self.model_dir, dtype=self.dtype, device_map=device_map, offload_folder=offload_dir
        )


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def compare(what: str, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> Check:
    if list(got) != list(expected):
        return Check(what, False, f"names differ: {sorted(set(got) ^ set(expected))[:5]}")
    worst = max(((max_abs_diff(got[n], expected[n]), n) for n in expected), default=(0.0, ""))
    equal = all(torch.equal(got[n].cpu(), expected[n].cpu()) for n in expected)
    detail = f"{len(expected)} tensors, max abs diff {worst[0]:.3g}" + (
        f" (at {worst[1]})" if worst[0] else ""
    )
    return Check(what, equal, detail + ("" if equal else "; not bit-equal"))


def model_devices(model: torch.nn.Module) -> list[str]:
    placed = getattr(model, "hf_device_map", None) or {"": str(next(model.parameters()).device)}
    return sorted({str(d) for d in placed.values()})


def check_split(setup: Setup, tokens: torch.Tensor) -> list[Check]:
    single, split = setup.single(), setup.split()
    devices = model_devices(split.model)
    if setup.simulate:
        placed = devices == ["cpu", "disk"]
    else:  # "auto" balances over the GPUs; every part must be on a GPU, on two of them at least
        placed = len(devices) >= 2 and all(d.isdigit() for d in devices)
    checks = [Check("split placement", placed, f"hf_device_map devices: {devices}")]
    logits, cache = single.run_with_cache(tokens)
    split_logits, split_cache = split.run_with_cache(tokens)
    where = sorted({str(v.device) for v in split_cache.values()})
    checks.append(compare("logits, split vs one device", {"": split_logits}, {"": logits}))
    checks.append(
        compare(f"every cached activation (kept on {where})", dict(split_cache), dict(cache))
    )
    _, gathered = split.run_with_cache(tokens, device="cpu")
    on_cpu = {str(v.device) for v in gathered.values()} == {"cpu"}
    checks.append(Check("run_with_cache(device='cpu') gathers", on_cpu, f"{len(gathered)} tensors"))
    last = f"blocks.{split.cfg.n_layers - 1}.{PATCHED}"
    seen: list[str] = []

    def ablate(x: torch.Tensor, hook) -> torch.Tensor:
        seen.append(str(x.device))
        return torch.zeros_like(x)

    patched = split.run_with_hooks(tokens, fwd_hooks=[(last, ablate)])
    expected = single.run_with_hooks(tokens, fwd_hooks=[(last, ablate)])
    check = compare(f"patched {last}", {"": patched}, {"": expected})
    check.detail += f"; hook saw a tensor on {seen[0]}"
    checks.append(check)
    return checks


def check_quantized(setup: Setup, tokens: torch.Tensor, scheme: str) -> list[Check]:
    from qlens.modules import QuantExperts, QuantLinear
    from qlens.modules.model_quantize import quantize

    reference = quantize(setup.single(), scheme, inplace=True)
    split = quantize(setup.split(offload=False), scheme, inplace=True)
    ran_on: set[str] = set()

    def record(_module: torch.nn.Module, args: tuple) -> None:
        ran_on.add(str(args[0].device))

    quantized = [m for m in split.model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    handles = [m.register_forward_pre_hook(record) for m in quantized]
    try:
        logits = split(tokens)
    finally:
        for handle in handles:
            handle.remove()
    held_on = {str(t.device) for m in quantized for t in [*m.parameters(), *m.buffers()]}
    spread = setup.simulate or len(held_on) >= 2
    checks = [
        Check(
            f"{scheme}: quantized modules ran on every device",
            bool(quantized) and ran_on == held_on and spread,
            f"{len(quantized)} modules held on {sorted(held_on)} ran on {sorted(ran_on)}",
        )
    ]
    finite = bool(torch.isfinite(logits).all())
    check = compare(f"{scheme}: logits, split vs one device", {"": logits}, {"": reference(tokens)})
    check.passed = check.passed and finite
    checks.append(check)
    return checks


def check_harvest(setup: Setup, tokens: torch.Tensor) -> list[Check]:
    from safetensors.torch import save_file

    from qlens.distributed.harvest import harvest
    from qlens.distributed.shards import load_harvest

    ranks = setup.n_devices
    # two examples per rank and batches of two: every rank runs the very batches the single
    # process runs (other batch shapes may pick other GEMM algorithms and round differently)
    vocab = SHAPES["cpu" if setup.simulate else "gpu"]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2 * ranks, tokens.shape[1]), generator=generator)
    dataset = setup.work / "tokens.safetensors"
    save_file({"tokens": tokens.cpu().contiguous()}, str(dataset))
    out = setup.work / "harvest"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), "-m", "qlens.distributed.harvest"]
    command += ["--model", str(setup.model_dir), "--names", HARVEST_NAMES]
    command += ["--dataset", str(dataset), "--out", str(out), "--batch-size", "2"]
    command += ["--dtype", str(setup.dtype).removeprefix("torch.")]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stderr, file=sys.stderr)
        detail = f"exit {run.returncode}: {one_line((run.stderr.strip().splitlines() or [''])[-1])}"
        return [Check(f"torchrun harvest, {ranks} ranks", False, detail)]
    single_dir = setup.work / "harvest-single"
    harvest(setup.single(), tokens, HARVEST_NAMES, single_dir, 2, rank=0, world_size=1)
    union, single = load_harvest(out), load_harvest(single_dir)
    check = compare(
        f"torchrun harvest, {ranks} ranks: union vs one process",
        union.activations,
        single.activations,
    )
    check.detail += (
        f"; {union.manifest['n_examples']} examples in {union.manifest['shards']} shards"
    )
    return [check]


def one_line(text: object) -> str:
    """Text fit for a markdown table cell."""
    return str(text).replace("\n", " ").replace("|", "/")[:500]


def versions() -> str:
    names = ("torch", "transformers", "accelerate", "triton", "safetensors", "qlens")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def devices_line(simulate: bool) -> str:
    if simulate:
        return (
            f"CPU simulation ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        )
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} GPUs: " + ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))


def build_checkpoint(directory: Path, shape: dict, dtype: torch.dtype) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpu-simulate", action="store_true", help="run the logic on CPU (disk-offload split)"
    )
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--examples", type=int, default=8, help="sequences in the batch")
    args = parser.parse_args(argv)
    simulate = args.cpu_simulate
    if not simulate and torch.cuda.device_count() < 2:
        parser.error(
            f"needs at least 2 GPUs, found {torch.cuda.device_count()}; pass --cpu-simulate "
            "to run the same checks on CPU"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    shape = SHAPES["cpu" if simulate else "gpu"]
    dtype = torch.float32 if simulate else torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="qlens-multi-gpu-") as tmp:
        work = Path(tmp)
        build_checkpoint(work / "model", shape, dtype)
        setup = Setup(
            simulate, dtype, 2 if simulate else torch.cuda.device_count(), work / "model", work
        )
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(
            0, shape["vocab_size"], (args.examples, args.seq_len), generator=generator
        )
        steps: list[tuple[str, Callable[[], list[Check]]]] = [
            ("split vs one device", lambda: check_split(setup, tokens))
        ]
        steps += [(s, lambda s=s: check_quantized(setup, tokens, s)) for s in SCHEMES]
        steps.append(("torchrun harvest", lambda: check_harvest(setup, tokens)))
        checks: list[Check] = []
        for label, step in steps:
            try:
                checks += step()
            except Exception as error:  # noqa: BLE001 - report every step, then fail
                traceback.print_exc()
                checks.append(Check(label, False, one_line(repr(error))))
            print(f"<!-- {checks[-1].what}: {checks[-1].passed} -->", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## qlens: model split across devices",
        "",
        f"- date: {stamp}",
        f"- devices: {devices_line(simulate)}",
        f"- versions: {versions()}, Python {platform.python_version()}",
        f"- command: `python {' '.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}`",
        f"- model: random-weight Llama {shape}, {str(dtype).removeprefix('torch.')}, "
        f"tokens [{args.examples}, {args.seq_len}]",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {c.what} | {'PASS' if c.passed else 'FAIL'} | {c.detail} |" for c in checks]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "multi_gpu.md").write_text(text + "\n")
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
