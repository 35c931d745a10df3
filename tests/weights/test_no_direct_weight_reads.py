"""qlens reads weights only through the guarded accessor layer (``qlens/weights/access.py``).

Scans the qlens source for direct weight reads: ``.weight`` (and ``.weight.data``),
``getattr(..., "weight")``, fused-experts tensors (``.gate_up_proj``/``.down_proj``),
``._parameters`` and ``named_parameters`` loops. Files allowed to read module storage directly are
listed with the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import qlens

ROOT = Path(qlens.__file__).resolve().parent

ALLOWED_DIRS = {
    # Quantization itself: packing, adopting HF quantized modules and swapping layers must read
    # the raw stored tensors (codes, scales) -- that is what the guard protects everyone else from.
    "quant": "implements quantization on raw storage",
    # Triton kernels and their dispatch consume packed payloads, never float weight matrices.
    "kernels": "consumes packed payloads",
    # The quantized modules (QuantLinear, QuantExperts, rerouting, quantize, save/load) build
    # payloads from, and swap, the stored tensors of the layers they replace.
    "modules": "builds packed modules from stored tensors",
}
ALLOWED_FILES = {
    # The accessor layer: the one place weights are read (and written) for analysis.
    "weights/access.py": "the guarded accessor layer",
    # Its write side: writes processed weights back and scans every parameter for unreadable
    # ones (to refuse or materialize them); it reads no values itself.
    "weights/storage.py": "writes processed weights and scans every parameter",
    # The weight audit of `qlens report`: lists every parameter's shape, dtype and stored bytes
    # (metadata only, never values) next to the guard's verdict on it.
    "report/audit.py": "lists every parameter's shape, dtype and size",
    # Loading: checks which stored tensors a checkpoint filled, swaps loaded tensors into their
    # modules and refuses float experts in quantized checkpoints (dtype checks, no values read).
    "load_checks.py": "checks checkpoint keys and expert dtypes",
    "packed_load.py": "records which parameters a packed load filled",
    "quantize_on_load.py": "quantizes each layer as its tensors arrive",
    # The bridge forwards nn.Module's parameter listing to the wrapped model.
    "bridge/model_api.py": "forwards named_parameters to the wrapped model",
    # A norm's hook recomputes the norm's own affine step in the forward, as the module does.
    "bridge/taps.py": "applies a norm's weight in its forward hook",
}
# Attribute reads, matched with string literals blanked out (adapter tables name module paths
# such as "mlp.down_proj" in strings), and getattr by name, matched on the code as written.
ATTRIBUTE_PATTERNS = [
    re.compile(r"\.weight\b"),
    re.compile(r"\.(gate_up_proj|down_proj)\b"),
    re.compile(r"\._parameters\b"),
    re.compile(r"\bnamed_parameters\("),
]
GETATTR_PATTERN = re.compile(r"""getattr\([^)]*["'](weight|gate_up_proj|down_proj)["']""")
STRING_LITERAL = re.compile(r"""(["'])(?:\\.|(?!\1).)*\1""")


def _reads_weight(code: str) -> bool:
    without_strings = STRING_LITERAL.sub('""', code)
    return bool(GETATTR_PATTERN.search(code)) or any(
        p.search(without_strings) for p in ATTRIBUTE_PATTERNS
    )


def _allowed(relative: str) -> bool:
    return relative in ALLOWED_FILES or relative.split("/")[0] in ALLOWED_DIRS


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines with comments stripped (docstrings may mention `.weight` in prose)."""
    lines, in_doc = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc or (quotes == 1 and stripped.startswith('"""')):
            in_doc = in_doc != (quotes == 1)
            continue
        if quotes >= 2 and stripped.startswith('"""'):
            continue
        lines.append((number, line.split("#", 1)[0]))
    return lines


def test_every_weight_read_goes_through_the_accessor_layer():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if _allowed(relative):
            continue
        for number, code in _code_lines(path):
            if _reads_weight(code):
                offenders.append(f"qlens/{relative}:{number}: {code.strip()}")
    assert not offenders, (
        "direct weight reads outside qlens.weights.access (read weights with "
        "qlens.weights.read_weight / read_tensor / read_experts instead):\n" + "\n".join(offenders)
    )


def test_the_scan_catches_direct_reads(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Docs may say module.weight."""\n'
        "w = module.weight.data  # a read\n"
        "x = getattr(module, 'weight', None)\n"
        "e = experts.gate_up_proj\n"
        "for name, p in model.named_parameters():\n"
        "    pass\n"
        "ok = module.weight_scale\n"
        'd = getattr(experts, "down_proj")\n'
        'path = "mlp.down_proj"\n'
    )
    flagged = [n for n, code in _code_lines(sample) if _reads_weight(code)]
    assert flagged == [2, 3, 4, 5, 8]


def test_allowed_files_exist():
    for relative in ALLOWED_FILES:
        assert (ROOT / relative).is_file(), f"stale exception: qlens/{relative} does not exist"
