"""The dense quantized-linear launches compiled for sm_90 on the CPU (no GPU needed): the
GPU-only code the interpreter never runs (inline assembly, Hopper's tensor-core dots) compiles
for the launches the H200 tables choose, and those launches spill no registers (known
exceptions, which must not grow). The launches
come from the real launch plans (``LinearPlan`` on the kernel route), recorded instead of run."""

from __future__ import annotations

import pytest
from sm90_compile import nvidia_tools, run_compile_script

RECORD_AND_COMPILE = """
import json, sys
import torch
import qlens.kernels.configs as configs
import qlens.kernels.dispatch as dispatch
import qlens.kernels.plan as plan
from qlens.kernels.fast_launch import FastLaunch, PreparedLaunch
from qlens.quant.quantize import quantize_weight
from sm90_compile import compile_sm90

# The H200's launch tables, with CPU tensors standing in for the GPU's.
configs.gpu_name = lambda device: "NVIDIA H200"
configs.sm_count = lambda device: 132
dispatch.require_kernel_device = lambda device: None
recorded = []
FastLaunch.launch = lambda self, grid, *args, **options: recorded.append(
    (self.kernel, args, options))
PreparedLaunch.__call__ = lambda self, *tensors: recorded.append(
    (self.launcher.kernel, self.arguments(*tensors), self._options))

CASES = [  # scheme, options, rows, FP8 activations
    ("int4", {"group_size": 128}, (1, 16, 48), False),
    ("mxfp4", {}, (1, 48), False),
    ("nvfp4", {}, (1, 16), False),
    ("fp8-block", {}, (1, 8), False),
    ("fp8-block", {}, (1, 8), True),
    ("int8", {}, (1,), False),
]
results = []


def compile_recorded(case):
    for kernel, args, launch in recorded:
        usage = compile_sm90(kernel, args, launch, sys.argv[1])
        results.append({"case": case, "kernel": kernel.__name__,
                        "use_dot": launch.get("USE_DOT"), "use_asm": launch.get("USE_ASM"),
                        "round_x": launch.get("ROUND_X"), "decoded": launch.get("DECODED"),
                        "x_as_is": launch.get("X_AS_IS"), "split_sum": launch.get("SPLIT_SUM"),
                        **usage})
    recorded.clear()


for scheme, options, row_counts, w8a8 in CASES:
    payload = quantize_weight(torch.randn(4096, 4096), scheme, **options)
    kernels = plan.LinearPlan(payload, torch.device("cpu"), route="kernel", w8a8=w8a8)
    for rows in row_counts:
        kernels(torch.randn(rows, 4096, dtype=torch.bfloat16))
        compile_recorded(f"{scheme}{' w8a8' if w8a8 else ''} {rows} rows")
from benchmarks._samples import random_bnb_4bit
from qlens.kernels.gemv import prepare_gemv
from qlens.kernels.weights import kernel_weight
bnb_payload = random_bnb_4bit((4096, 4096), 64, nested=False)
nf4 = plan.LinearPlan(bnb_payload, torch.device("cpu"), route="kernel")
for rows in (1, 16):  # bitsandbytes' own bytes: the word-wise GEMV, then decoded once
    nf4(torch.randn(rows, 4096, dtype=torch.bfloat16))
    compile_recorded(f"bnb-nf4 {rows} rows")
packed = configs.choose_config(16, 4096, 4096, torch.device("cpu"), packed_words=True)
prepare_gemv(kernel_weight(bnb_payload), 16, torch.bfloat16, False, packed)(
    torch.randn(16, 4096, dtype=torch.bfloat16), None)  # table lookups on tensor cores
compile_recorded("bnb-nf4 16 rows packed")
import dataclasses
chosen = plan._weight_config  # tensor-core rows read as they are (LinearConfig.x_as_is)
plan._weight_config = lambda *a, **k: dataclasses.replace(chosen(*a, **k), x_as_is=True)
for scheme, options, _, _ in CASES[:3]:
    payload = quantize_weight(torch.randn(4096, 4096), scheme, **options)
    kernels = plan.LinearPlan(payload, torch.device("cpu"), route="kernel")
    for rows in (16, 32):
        kernels(torch.randn(rows, 4096, dtype=torch.bfloat16))
        compile_recorded(f"{scheme} {rows} rows as is")
# K splits summed in the kernel (LinearConfig.split_sum), rows regrouped and as they are
for as_is in (False, True):
    plan._weight_config = lambda *a, as_is=as_is, **k: dataclasses.replace(
        chosen(*a, **k), x_as_is=as_is, split_sum=True)
    for scheme, options, _, _ in CASES[:3]:
        payload = quantize_weight(torch.randn(4096, 4096), scheme, **options)
        kernels = plan.LinearPlan(payload, torch.device("cpu"), route="kernel")
        kernels(torch.randn(16, 4096, dtype=torch.bfloat16))
        compile_recorded(f"{scheme} 16 rows{' as is' if as_is else ''}, summed")
plan._weight_config = chosen
from qlens.kernels.fp8_w8a8 import fp8_rounded_rows
fp8_rounded_rows(torch.randn(8, 4096, dtype=torch.bfloat16), 128)
compile_recorded("fp8-rounded rows")
from qlens.kernels.sibling_gemv import sibling_gemv
from qlens.kernels.weights import kernel_weight
for scheme, options, _, w8a8 in CASES:  # q, k and v of an 8B layer
    views = [kernel_weight(quantize_weight(torch.randn(n, 4096), scheme, **options))
             for n in (4096, 1024, 1024)]
    sibling_gemv(views, torch.bfloat16, False, torch.device("cpu"), round_x=w8a8)(
        torch.randn(1, 4096, dtype=torch.bfloat16), None)
    compile_recorded(f"{scheme}{' w8a8' if w8a8 else ''} siblings")
import qlens.kernels.experts as experts
experts.kernel_device_problem = lambda device: None
for scheme, options, _, _ in CASES[:3]:  # one token's 8 routed rows of packed 4-bit experts
    plan = experts.ExpertsPlan(
        quantize_weight(torch.randn(8, 1536, 2048), scheme, **options), torch.device("cpu"))
    plan.rows(torch.randn(8, 2048, dtype=torch.bfloat16), torch.arange(8), None)
    compile_recorded(f"{scheme} experts")

print(json.dumps(results))
"""


# Launches that spill, which the H200 tables chose by their measured times (spills included):
# bytes of stack a thread, which must not grow. The tensor-core weight-only kernel at two row
# counts; the E2M1 GEMV's 32 rows read as they are.
KNOWN_SPILLS = {
    ("mxfp4 48 rows", "_weight_only_kernel"): 344,
    ("fp8-block 8 rows", "_weight_only_kernel"): 784,
    # tensor-core rows read as they are, their K splits summed in the kernel (kernel notes 66,
    # 68: one launch a call, less host and wall time than two without these spills)
    ("mxfp4 32 rows as is", "packed_gemv_kernel"): 40,
    ("nvfp4 32 rows as is", "packed_gemv_kernel"): 24,
}
# Barriers of a one-row packed GEMV reading x as it is: its epilogue's reductions only. Decoded
# codes that crossed shared memory to meet x cost eight exchanges a K step (over 130 barriers).
AS_IS_ROW_MAX_BARRIERS = 8


@pytest.mark.skipif(nvidia_tools() is None, reason="Triton's NVIDIA backend tools are missing")
def test_the_dispatchers_h200_launches_compile_for_sm90_without_spills():
    results = run_compile_script(RECORD_AND_COMPILE)
    assert len(results) >= 12
    # W8A8's one row: one GEMV rounding the row in the kernel; the experts' rounding launch.
    one_w8a8_row = [r for r in results if r["case"] == "fp8-block w8a8 1 rows"]
    assert [(r["kernel"], r["round_x"]) for r in one_w8a8_row] == [("_gemv_kernel", True)]
    rounded = [r for r in results if r["case"] == "fp8-rounded rows"]
    assert [(r["kernel"], r["decoded"]) for r in rounded] == [("_act_quant_kernel", True)]
    siblings = {
        r["case"]: (r["kernel"], r["round_x"]) for r in results if r["case"].endswith("siblings")
    }
    assert siblings == {
        "int4 siblings": ("packed_siblings_gemv_kernel", None),
        "mxfp4 siblings": ("packed_siblings_gemv_kernel", None),
        "nvfp4 siblings": ("packed_siblings_gemv_kernel", None),
        "fp8-block siblings": ("byte_siblings_gemv_kernel", False),
        "fp8-block w8a8 siblings": ("byte_siblings_gemv_kernel", True),
        "int8 siblings": ("byte_siblings_gemv_kernel", False),
    }
    as_is: dict[str, list[tuple[str, bool, bool, bool]]] = {}
    for r in results:
        if r["case"].endswith("as is"):
            as_is.setdefault(r["case"], []).append(
                (r["kernel"], r["use_dot"], r["x_as_is"], r["split_sum"])
            )
    assert as_is == {  # by default one launch, its K splits summed in the kernel
        f"{scheme} {rows} rows as is": [("packed_gemv_kernel", True, True, True)]
        for scheme in ("int4", "mxfp4", "nvfp4")
        for rows in (16, 32)
    }
    summed: dict[str, list[tuple[str, bool]]] = {}
    for r in results:
        if r["case"].endswith("summed"):
            summed.setdefault(r["case"], []).append((r["kernel"], r["split_sum"]))
    assert summed == {  # one launch: no reducing launch after the split GEMV
        f"{scheme} 16 rows{as_is}, summed": [("packed_gemv_kernel", True)]
        for scheme in ("int4", "mxfp4", "nvfp4")
        for as_is in ("", " as is")
    }
    regrouped = [r for r in results if r["case"] in ("int4 16 rows", "nvfp4 16 rows")]
    assert {(r["kernel"], r["x_as_is"]) for r in regrouped if r["use_dot"]} == {
        ("packed_gemv_kernel", False)
    }
    nf4 = {(r["case"], r["kernel"], r["use_dot"]) for r in results if "bnb-nf4" in r["case"]}
    reduced = {("bnb-nf4 16 rows packed", "_reduce_splits_kernel", None)}  # a first call's
    assert nf4 - reduced == {  # bitsandbytes' bytes: one row in FMAs, more decoded once
        ("bnb-nf4 1 rows", "packed_gemv_kernel", False),
        ("bnb-nf4 16 rows", "_dequant_kernel", None),
        ("bnb-nf4 16 rows packed", "packed_gemv_kernel", True),
    }
    experts_rows = {
        r["case"]: (r["kernel"], r["use_dot"]) for r in results if "experts" in r["case"]
    }
    assert experts_rows == {  # one row a program, in FMAs
        f"{scheme} experts": ("packed_gemv_kernel", False) for scheme in ("int4", "mxfp4", "nvfp4")
    }
    for result in results:
        spill_limit = KNOWN_SPILLS.get((result["case"], result["kernel"]), 0)
        assert result["stack"] <= spill_limit, result  # registers spilled to local memory
        if result["use_asm"] is not None:
            assert result["use_asm"], result  # the GPU decode, not the interpreter's
        if result["use_dot"]:
            assert result["mma"], result  # tensor-core dots
        if result["kernel"].startswith("packed_") and not result["use_dot"]:  # one row as it is
            assert result["barriers"] <= AS_IS_ROW_MAX_BARRIERS, result
        if result["word_load_bytes"] is not None:
            # Packed words stream in 16-byte loads. (One-row GEMVs that loaded one 4-byte word a
            # thread, so the decoded codes met x's split without shared memory, ran five times
            # slower on the GPU: benchmarks/results/archive/gemv_one_word_a_thread_h100.md.)
            assert result["word_load_bytes"] == 16, result
