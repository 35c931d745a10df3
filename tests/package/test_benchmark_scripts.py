"""Every benchmark script imports on the CPU, has a main() and says how to run it: a renamed
helper or a launch table built at import with a bad tile fails here, not on the GPU machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_the_benchmarks_folder_has_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import their siblings, as when run
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
    command = f"python benchmarks/{script.name}"
    assert module.__doc__ and command in module.__doc__, (
        f"{script.name}'s docstring lacks {command}"
    )


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("int4", {"group_size": 64}), ("int4", {"group_size": 32, "asymmetric": True}),
     ("mxfp4", {}), ("nvfp4", {})],
)  # fmt: skip
def test_w4a16_gemm_prototype_matches_the_float32_product(scheme, options, monkeypatch):
    """The prototype of ``w4a16_gemm.py`` (weight as the left operand) in Triton's interpreter,
    on ragged rows, columns and K: within bf16 output rounding of the float32 product."""
    import torch

    from qlens.kernels.dequant import dequantize_triton
    from qlens.kernels.runtime import interpreting
    from qlens.quant.quantize import quantize_weight

    if not interpreting():
        pytest.skip("runs the kernel on CPU tensors (TRITON_INTERPRET=1)")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from w4a16_gemm import swapped_w4a16_linear

    generator = torch.Generator().manual_seed(0)
    payload = quantize_weight(torch.randn(80, 320, generator=generator), scheme, **options)
    x = torch.randn(37, 320, generator=generator).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), dequantize_triton(payload, torch.float32))
    for launch in ((64, 32, 64, 4, 2), (32, 16, 128, 4, 1)):
        out = swapped_w4a16_linear(x, payload, launch).float()
        assert ((out - exact).norm() / exact.norm()).item() < 4e-3, launch  # bf16: 2**-9 each
