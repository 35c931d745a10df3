"""The kernels compiled for a real GPU against the torch reference (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import SCHEMES, quantized, rel_err, scheme_id

from qlens.kernels import LinearConfig, choose_config, dequantize_triton, quantized_linear
from qlens.kernels.fp8_w8a8 import quantize_activations
from qlens.kernels.gemv import prepare_gemv
from qlens.kernels.reference import (
    reference_act_quant,
    reference_linear,
    reference_w8a8_linear,
)
from qlens.kernels.runtime import interpreting
from qlens.kernels.sibling_gemv import SiblingGemv, sibling_gemv
from qlens.kernels.weights import kernel_weight
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreting(),
        reason="needs a CUDA GPU with TRITON_INTERPRET=0",
    ),
]
# bf16 weights/outputs round at 2**-9 relative; fp16 at 2**-11; fp32 runs IEEE dots.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-5}
CONFIGS = (
    None,
    LinearConfig("gemv", 16, 64, 128, split_k=2),
    LinearConfig("splitk", 16, 32, 64, split_k=3),
    LinearConfig("gemm", 64, 64, 32, num_warps=4),
    LinearConfig("dequant", 16, 16, 16),
)


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_dequantize_kernel_bit_exact_on_gpu(case):
    p = quantized(300, 520, case).to("cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_triton(p, dtype), dequantize(p, dtype))


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_weight_only_linear_matches_reference_on_gpu(case, dtype):
    p = quantized(300, 520, case).to("cuda")
    weight = dequantize(p, torch.float64)
    bias = torch.randn(300, device="cuda").to(dtype)
    for m in (1, 3, 7, 300):
        x = torch.randn(2, m, 520, device="cuda").to(dtype)
        ref = torch.nn.functional.linear(x.double(), weight, bias.double())
        for cfg in CONFIGS:
            out = quantized_linear(x, p, bias, config=cfg)
            assert out.dtype == dtype and out.shape == ref.shape
            assert rel_err(out, ref) < TOLERANCE[dtype], (m, cfg)


@pytest.mark.parametrize("case", SCHEMES[:3], ids=scheme_id)
def test_w8a8_matches_reference_on_gpu(case):
    p = quantized(300, 520, case).to("cuda")
    for m in (1, 40, 600):
        x = torch.randn(m, 520, device="cuda", dtype=torch.bfloat16)
        ref = reference_w8a8_linear(x.double(), p)
        for cfg in (
            None,
            LinearConfig("splitk", 16, 64, 128, split_k=2),
        ):
            err = rel_err(quantized_linear(x, p, w8a8=True, config=cfg), ref)
            assert err < 8e-3, (m, cfg, err)


@pytest.mark.parametrize("case", SCHEMES[:3], ids=scheme_id)
def test_one_w8a8_row_is_rounded_as_the_reference_rounds_it_on_gpu(case):
    """The GEMV's FP8 rounding of a row (hardware e4m3 conversion) against torch's: the same
    products, so only float32 summation order and the bf16 output rounding remain."""
    from qlens.kernels.reference import fp8_rounded_activations

    p = quantized(300, 520, case).to("cuda")
    x = (torch.randn(1, 520, device="cuda") * torch.logspace(-6, 3, 520, device="cuda")).bfloat16()
    exact = reference_linear(fp8_rounded_activations(x.float(), p.format.block[1]).double(), p)
    for cfg in (None, LinearConfig("gemv", 16, 8, 512, num_stages=4)):
        out = quantized_linear(x, p, w8a8=True, config=cfg)
        torch.testing.assert_close(
            out.double(), exact, rtol=2**-7, atol=1e-6 * exact.abs().max().item()
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_rounded_rows_match_torch_on_gpu(dtype):
    from qlens.kernels.fp8_w8a8 import fp8_rounded_rows
    from qlens.kernels.reference import fp8_rounded_activations

    x = (torch.randn(37, 520, device="cuda") * torch.logspace(-6, 3, 520, device="cuda")).to(dtype)
    x[3] = 0.0
    for group in (128, 64):
        expected = fp8_rounded_activations(x, group).to(dtype)
        assert torch.equal(fp8_rounded_rows(x, group), expected), group


SPLIT_LAUNCHES = (
    (("int4", {"group_size": 128}), False, 1, LinearConfig("gemv", 16, 4, 1024, 1, num_warps=1)),
    (("int4", {"group_size": 128}), False, 3, LinearConfig("gemv", 16, 32, 1024, 1)),
    (("nvfp4", {}), False, 16, LinearConfig("gemv", 16, 64, 256)),
    # One E2M1 row read as it is: 8-row tiles pipelined 3 deep, on one warp or two.
    (("mxfp4", {}), False, 1, LinearConfig("gemv", 16, 8, 2048, 1, num_warps=2, num_stages=3)),
    (("nvfp4", {}), False, 1, LinearConfig("gemv", 16, 8, 1024, 1, num_warps=1, num_stages=3)),
    (("fp8-block", {}), False, 1, LinearConfig("gemv", 16, 16, 512, num_stages=4)),
    (("fp8-block", {}), True, 1, LinearConfig("splitk", 16, 64, 128, num_stages=4)),
    (("fp8-block", {}), True, 8, LinearConfig("splitk", 16, 64, 128)),
    (("mxfp4", {}), False, 20, LinearConfig("splitk", 16, 128, 128)),
    (("mxfp4", {}), False, 48, LinearConfig("gemm", 64, 64, 128)),
    (("nvfp4", {}), False, 64, LinearConfig("gemm", 64, 64, 128)),
    (
        ("int4", {"group_size": 128, "asymmetric": True}),
        False,
        40,
        LinearConfig("gemm", 64, 64, 128),
    ),
)


@pytest.mark.parametrize("case, w8a8, m, base", SPLIT_LAUNCHES, ids=lambda v: str(v)[:40])
def test_split_launches_on_gpu(case, w8a8, m, base):
    """Every decode launch at several K splits: the reference's result, the same on every
    repeat (the partials are summed in split order)."""
    from dataclasses import replace

    p = quantized_weight_on_gpu(case, 2304, 4096)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2304, device="cuda", dtype=torch.bfloat16)
    reference = reference_w8a8_linear if w8a8 else reference_linear
    ref = reference(x.double(), p, bias.double())
    for split in (1, 2, 4, 8):
        cfg = replace(base, split_k=split)
        runs = [quantized_linear(x, p, bias, w8a8=w8a8, config=cfg) for _ in range(5)]
        assert all(torch.equal(r, runs[0]) for r in runs)
        assert rel_err(runs[0], ref) < 8e-3, split


def quantized_weight_on_gpu(case, n, k):
    scheme, kwargs = case
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return quantize_weight(w, scheme, **kwargs)


def test_activation_quant_matches_reference_on_gpu():
    x = torch.randn(77, 1000, device="cuda") * torch.logspace(-10, 3, 1000, device="cuda")
    x[5] = 0
    codes, scales = quantize_activations(x.bfloat16(), 128)
    for device in ("cpu", "cuda"):  # the reference divides the same way on both
        ref_codes, ref_scales = reference_act_quant(x.bfloat16().to(device), 128)
        assert torch.equal(scales.to(device), ref_scales)
        assert torch.equal(codes.view(torch.uint8).to(device), ref_codes.view(torch.uint8))


def test_dispatcher_paths_on_gpu():
    device = torch.device("cuda")
    assert choose_config(1, 28672, 8192, device).path == "gemv"
    assert choose_config(16, 28672, 8192, device).path == "splitk"
    assert choose_config(4096, 28672, 8192, device).path in ("gemm", "dequant")
    assert choose_config(16, 4096, 4096, device, w8a8=True).path == "splitk"


def test_w8a8_cublas_path_matches_reference_on_gpu():
    p = quantized(256, 1024, SCHEMES[0]).to("cuda")
    cfg = LinearConfig("cublas", 128, 128, 128, num_warps=8)
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    for m in (1024, 1000):  # 1000 rows do not fit cuBLAS and take the Triton GEMM
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = reference_w8a8_linear(x.double(), p, bias.double())
        assert rel_err(quantized_linear(x, p, bias, w8a8=True, config=cfg), ref) < 8e-3


PACKED_4BIT = tuple(case for case in SCHEMES if case[0] in ("int4", "mxfp4", "nvfp4"))
WORD_LAUNCHES = (
    LinearConfig("gemv", 16, 32, 256),
    LinearConfig("gemv", 16, 16, 1024, num_warps=8),
    LinearConfig("gemv", 16, 64, 128, split_k=3),
    LinearConfig("gemv", 16, 128, 256, num_warps=8, split_k=2),
    LinearConfig("gemv", 16, 8, 4096, num_warps=4),
    LinearConfig("gemv", 16, 16, 1024, num_warps=1, split_k=2),
    LinearConfig("gemv", 32, 64, 256),  # 32 rows a program (the 17-64-row launch)
    # rows on tensor cores read as they are, split by code position in registers
    LinearConfig("gemv", 16, 64, 128, split_k=3, x_as_is=True),
    LinearConfig("gemv", 32, 64, 256, x_as_is=True),
)


@pytest.mark.parametrize("case", PACKED_4BIT, ids=scheme_id)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_word_gemv_matches_reference_on_gpu(case, dtype, monkeypatch):
    """The word-wise GEMV (FMAs for one row, tensor-core dots beyond) on whole-word rows."""
    from qlens.kernels.gemv import FMA_MAX_ROWS, word_view

    p = quantized(300, 1024, case).to("cuda")
    assert word_view(kernel_weight(p)) is not None
    weight = dequantize(p, torch.float64)
    bias = torch.randn(300, device="cuda").to(dtype)
    for m in (1, 2, 4, 5, 16, 40, 64):
        x = torch.randn(m, 1024, device="cuda").to(dtype)
        ref = torch.nn.functional.linear(x.double(), weight, bias.double())
        for cfg in WORD_LAUNCHES:
            if m > FMA_MAX_ROWS and cfg.block_n < 16:
                continue  # tensor-core dots take no narrow tiles (test_config_validation)
            assert rel_err(quantized_linear(x, p, bias, config=cfg), ref) < TOLERANCE[dtype], (
                m,
                cfg,
            )


@pytest.mark.parametrize("case", PACKED_4BIT, ids=scheme_id)
def test_k_splits_summed_in_the_kernel_on_gpu_eagerly_and_in_cuda_graphs(case):
    """``split_sum=True``: the tile counters' acquire-release handshake on real SMs gives the
    reducing launch's output bit for bit, in back-to-back eager calls (counters reused, left
    at zero) and in replays of a CUDA graph captured after eager calls on another stream (its
    own counters, zeroed by a captured memset)."""
    import dataclasses

    from qlens.kernels import splits

    p = quantized(1000, 4096, case).to("cuda")
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    for m in (2, 16, 32):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        for as_is in (True, False):
            base = LinearConfig(
                "gemv", 16 if m <= 16 else 32, 64, 256, split_k=4, x_as_is=as_is, split_sum=False
            )
            summed = dataclasses.replace(base, split_sum=True)
            expected = quantized_linear(x, p, bias, config=base)
            eager = [quantized_linear(x, p, bias, config=summed) for _ in range(4)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                quantized_linear(x, p, bias, config=summed)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = quantized_linear(x, p, bias, config=summed)
            replays = []
            for _ in range(3):
                graph.replay()
                replays.append(captured.clone())
            for out in (*eager, *replays, quantized_linear(x, p, bias, config=summed)):
                assert torch.equal(out, expected), (m, as_is)
    kept = splits.split_counters(torch.device("cuda"), 1)
    torch.cuda.synchronize()
    assert not kept.any()


@pytest.mark.parametrize("case", PACKED_4BIT, ids=scheme_id)
def test_word_gemv_long_rows_on_gpu(case, monkeypatch):
    """Several full K tiles and a ragged tail (K = 2 * 4096 + 256) on the one-row layouts."""
    from qlens.kernels.gemv import FMA_MAX_ROWS

    p = quantized(72, 8448, case).to("cuda")
    weight = dequantize(p, torch.float64)
    for m in (1, 3):
        x = torch.randn(m, 8448, device="cuda").to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), weight)
        for cfg in (
            LinearConfig("gemv", 16, 8, 4096),
            LinearConfig("gemv", 16, 4, 1024, num_warps=1),
            LinearConfig("gemv", 16, 4, 1024, num_warps=1, num_stages=1),
            LinearConfig("gemv", 16, 4, 2048, num_warps=2, num_stages=2),
            LinearConfig("gemv", 16, 8, 1024, num_warps=1, split_k=3, num_stages=4),
            LinearConfig("gemv", 16, 32, 1024),
            LinearConfig("gemv", 16, 32, 1024, x_as_is=True),
        ):
            if m > FMA_MAX_ROWS and cfg.block_n < 16:
                continue  # tensor-core dots take no narrow tiles (test_config_validation)
            out = quantized_linear(x, p, config=cfg)
            assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], (m, cfg)


@pytest.mark.parametrize("case", PACKED_4BIT, ids=scheme_id)
def test_experts_one_launch_on_gpu(case):
    """Few (token, expert) rows of stacked 4-bit experts in one word-wise GEMV launch."""
    from qlens.kernels import experts_linear
    from qlens.kernels.experts import stacked_experts

    name, kwargs = case
    torch.manual_seed(0)
    p = quantize_weight(torch.randn(6, 200, 1024), name, **kwargs).to("cuda")
    ids = torch.tensor([5, 0, 5, 2, 3, 0, 1], device="cuda")
    assert stacked_experts(p, ids) is not None
    weight = dequantize(p, torch.float64)
    bias = torch.randn(6, 200, device="cuda").to(torch.bfloat16)
    x = torch.randn(7, 1024, device="cuda").to(torch.bfloat16)
    ref = torch.einsum("tk,tnk->tn", x.double(), weight[ids]) + bias.double()[ids]
    assert rel_err(experts_linear(x, p, ids, bias), ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_siblings_share_one_launch_on_gpu(case):
    """q/k/v of an 8B layer in one launch: each sibling's columns equal its own one-row GEMV
    with the shared tile, and its own launch (the H200 table's tile) within the bf16 tolerance."""
    device = torch.device("cuda")
    payloads = [
        quantized(n, 4096, case, seed=i).to("cuda") for i, n in enumerate((4096, 1024, 1024))
    ]
    views = [kernel_weight(p) for p in payloads]
    biases = [torch.randn(p.shape[0], device="cuda").bfloat16() for p in payloads]
    shared = sibling_gemv(views, torch.bfloat16, True, device)
    assert isinstance(shared, SiblingGemv), shared
    x = torch.randn(1, 1, 4096, device="cuda").bfloat16()
    for w, p, bias, out in zip(views, payloads, biases, shared(x, biases), strict=True):
        own = prepare_gemv(w, 1, torch.bfloat16, True, shared.config, (1, 1, w.n))
        assert torch.equal(out, own(x, bias))
        alone = quantized_linear(x, p, bias)
        assert rel_err(out, alone) < TOLERANCE[torch.bfloat16]


def test_fp8_rounded_siblings_share_one_launch_on_gpu():
    """W8A8's q/k/v at one row: one launch reading the row rounded to FP8, each sibling equal to
    its own rounded one-row GEMV with the shared tile."""
    device = torch.device("cuda")
    payloads = [
        quantized(n, 4096, SCHEMES[0], seed=i).to("cuda") for i, n in enumerate((4096, 1024, 1024))
    ]
    views = [kernel_weight(p) for p in payloads]
    shared = sibling_gemv(views, torch.bfloat16, False, device, round_x=True)
    assert isinstance(shared, SiblingGemv), shared
    x = (
        torch.randn(1, 4096, device="cuda") * torch.logspace(-6, 3, 4096, device="cuda")
    ).bfloat16()
    for w, p, out in zip(views, payloads, shared(x, None), strict=True):
        own = prepare_gemv(w, 1, torch.bfloat16, False, shared.config, round_x=True)
        assert torch.equal(out, own(x, None))
        assert rel_err(out, reference_w8a8_linear(x.double(), p)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_plan_prefill_rows_take_the_prepared_decode_on_gpu(case):
    """Prefill rows through a plan (the modules' path) on the dequantize path: exactly
    ``F.linear`` on the codec's decoded weight, on the first call and on the kept launch."""
    import torch.nn.functional as F

    from qlens.kernels.dequant import DequantizedLinear
    from qlens.kernels.plan import LinearPlan

    payload = quantized(512, 1024, case).to("cuda")
    plan = LinearPlan(payload, torch.device("cuda"))
    x = torch.randn(1, 300, 1024, device="cuda").to(torch.bfloat16)
    bias = torch.randn(512, device="cuda").to(torch.bfloat16)
    expected = F.linear(x, dequantize(payload, torch.bfloat16), bias)
    assert plan.config(300).path == "dequant"
    for _ in range(2):
        assert torch.equal(plan(x, bias), expected)
    assert isinstance(plan._calls[x.shape, x.dtype, False], DequantizedLinear)


@pytest.mark.parametrize("rows", [32, 48])
@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_plan_few_rows_take_the_prepared_weight_only_launch_on_gpu(case, rows):
    """Rows on the weight-only path (``"splitk"``, ``"gemm"``) through a plan: the kept
    prepared launch (direct launches from the second call) gives exactly the unprepared
    launch's output, with and without bias."""
    from qlens.kernels.plan import LinearPlan
    from qlens.kernels.weight_only import PreparedWeightOnly, weight_only_linear

    payload = quantized(512, 1024, case).to("cuda")
    plan = LinearPlan(payload, torch.device("cuda"))
    config = plan.config(rows)
    if config.path not in ("splitk", "gemm"):
        pytest.skip(f"{rows} rows of this scheme take the {config.path!r} path")
    x = torch.randn(1, rows, 1024, device="cuda").to(torch.bfloat16)
    bias = torch.randn(512, device="cuda").to(torch.bfloat16)
    view = kernel_weight(payload)
    for b in (bias, None):
        expected = weight_only_linear(x.reshape(rows, 1024), view, b, config).view(1, rows, 512)
        for _ in range(3):
            assert torch.equal(plan(x, b), expected)
        assert isinstance(plan._calls[x.shape, x.dtype, b is None], PreparedWeightOnly)
