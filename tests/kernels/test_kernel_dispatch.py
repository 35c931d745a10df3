"""The dispatcher's choices and the clear errors of the public kernel API."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import quantized

from qlens.kernels import LinearConfig, choose_config, quantized_linear, supports
from qlens.kernels.configs import GEMV_MAX_M, SPLITK_MAX_M


def test_small_batches_take_the_decode_paths_and_large_the_gemm_path():
    cpu = torch.device("cpu")
    for m in (1, GEMV_MAX_M):
        assert choose_config(m, 4096, 4096, cpu).path == "gemv"
    # W8A8's one row: the GEMV reads it rounded to FP8; more rows are quantized for FP8 dots.
    assert choose_config(1, 4096, 4096, cpu, w8a8=True) == choose_config(1, 4096, 4096, cpu)
    assert choose_config(GEMV_MAX_M, 4096, 4096, cpu, w8a8=True).path == "splitk"
    for m in (GEMV_MAX_M + 1, SPLITK_MAX_M):
        assert choose_config(m, 4096, 4096, cpu).path == "splitk"
        assert choose_config(m, 4096, 4096, cpu, w8a8=True).path == "splitk"
    for m in (SPLITK_MAX_M + 1, 4096):
        assert choose_config(m, 4096, 4096, cpu).path == "gemm"


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig("gemm", 48, 64, 64)
    with pytest.raises(ValueError, match="split_k"):
        LinearConfig("splitk", 16, 64, 64, split_k=0)
    from qlens.kernels.dequant import DequantLaunch

    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 8"):
        DequantLaunch(32, 8)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 1, got 3"):
        DequantLaunch(3, 64)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 8"):
        LinearConfig("splitk", 16, 8, 64)
    narrow = LinearConfig("gemv", 16, 8, 64)  # the one-row FMA GEMV's tiles may be narrow...
    payload = quantized(16, 64, ("int4", {"group_size": 32}))
    x = torch.randn(1, 64)
    assert quantized_linear(x, payload, config=narrow).shape == (1, 16)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 8"):
        quantized_linear(torch.randn(2, 64), payload, config=narrow)  # ...not tensor-core ones


def test_supports():
    payload = quantized(16, 64, ("int4", {"group_size": 32}))
    assert supports(payload, "cpu")  # the interpreter runs CPU tensors in the tests
    assert not supports(quantized(16, 64, ("int8", {"group_size": 32})).to("meta"), "meta")
    payload.layout = {"packing": "gptq"}
    assert not supports(payload, "cpu")


def test_cpu_without_interpreter_points_at_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    payload = quantized(16, 64, ("int4", {"group_size": 32}))
    with pytest.raises(RuntimeError, match="reference_linear"):
        quantized_linear(torch.randn(2, 64), payload)


def test_bad_inputs_raise_clear_errors():
    payload = quantized(16, 64, ("mxfp4", {}))
    with pytest.raises(ValueError, match="in_features 64"):
        quantized_linear(torch.randn(2, 65), payload)
    with pytest.raises(ValueError, match="activations"):
        quantized_linear(torch.randn(2, 64).double(), payload)
    with pytest.raises(ValueError, match=r"bias must have shape \[16\]"):
        quantized_linear(torch.randn(2, 64), payload, torch.randn(15))
    payload.layout = {**payload.layout, "scale_swizzle": "32_4_4"}
    with pytest.raises(ValueError, match="scale_swizzle"):
        quantized_linear(torch.randn(2, 64), payload)


def test_empty_batch():
    payload = quantized(16, 64, ("int8", {"group_size": 32}))
    assert quantized_linear(torch.randn(0, 64), payload).shape == (0, 16)


@pytest.fixture
def h200(monkeypatch):
    """The dispatcher as it sees an H200 (name and SM count faked: no GPU needed); yields the
    ``configs`` module, for tests that fake another GPU."""
    import qlens.kernels.configs as configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    return configs


def test_h200_table_gives_packed_words_their_own_launches(h200):
    """The tuned tables as a GPU sees them."""
    gpu = torch.device("cuda")
    word = choose_config(1, 28672, 8192, gpu, packed_words=True)
    byte = choose_config(1, 28672, 8192, gpu)
    assert (word.path, word.block_n, word.block_k, word.split_k) == ("gemv", 4, 1024, 1)
    # Few one-row programs (up to 8 per SM) stream 2048 K per step on two warps.
    few = choose_config(1, 4096, 14336, gpu, packed_words=True)
    assert (few.block_n, few.block_k, few.num_warps, few.split_k) == (4, 2048, 2, 1)
    assert choose_config(1, 6144, 4096, gpu, packed_words=True).block_k == 1024
    # int4 takes the same one-row launch as the other packed elements.
    for n, k in ((28672, 8192), (6144, 4096), (4096, 14336)):
        int4 = choose_config(1, n, k, gpu, packed_words=True, int4=True)
        assert int4 == choose_config(1, n, k, gpu, packed_words=True), (n, k)
    assert choose_config(2, 28672, 8192, gpu, packed_words=True, int4=True).block_n == 64
    two_rows = choose_config(2, 28672, 8192, gpu, packed_words=True)  # tensor cores from 2 rows
    assert (two_rows.block_n, two_rows.block_k) == (64, 256)
    assert (byte.path, byte.block_n, byte.block_k, byte.num_stages) == ("gemv", 16, 512, 4)
    sixteen = choose_config(16, 28672, 8192, gpu, packed_words=True)
    assert (sixteen.path, sixteen.block_n, sixteen.block_k) == ("gemv", 64, 256)
    assert choose_config(16, 28672, 8192, gpu).path == "splitk"
    # 17-32 rows: 32-row programs on the packed GEMV; int4 keeps them up to 64 rows.
    for m, int4 in ((17, False), (32, False), (33, True), (64, True)):
        mid = choose_config(m, 28672, 8192, gpu, packed_words=True, int4=int4)
        assert (mid.path, mid.block_m, mid.block_n, mid.block_k) == ("gemv", 32, 64, 256)
        assert mid.split_k == 1  # 448 or more programs: over two per SM already
    # 32-row programs double the split while the grid stays within two programs per SM.
    for m, n, k, splits in (
        (24, 4096, 4096, 4),  # 64 programs -> 256
        (32, 4096, 14336, 4),
        (64, 4096, 14336, 2),  # two row tiles: 128 programs -> 256
        (32, 14336, 4096, 1),  # 224 programs: doubling would make 448
        (24, 4096, 512, 2),  # at most one split per K step
    ):
        mid = choose_config(m, n, k, gpu, packed_words=True, int4=True)
        assert (mid.block_m, mid.split_k) == (32, splits), (m, n, k)
    # MXFP4 / NVFP4 words from 33 to 64 rows: the GEMM path, K split 4 ways where each split
    # keeps four K steps; from 65 rows dequantize + cuBLAS.
    for m, k, splits in ((33, 8192, 4), (64, 4096, 4), (48, 1024, 2), (40, 384, 1)):
        gemm = choose_config(m, 28672, k, gpu, packed_words=True)
        assert (gemm.path, gemm.block_m, gemm.block_n, gemm.block_k) == ("gemm", 64, 64, 128)
        assert gemm.split_k == splits, (m, k)
    assert choose_config(65, 28672, 8192, gpu, packed_words=True).path == "dequant"
    assert choose_config(65, 28672, 8192, gpu, packed_words=True, int4=True).path == "dequant"
    assert choose_config(32, 28672, 8192, gpu).path == "splitk"  # not packed words
    assert choose_config(4096, 28672, 8192, gpu, packed_words=True).path == "dequant"
    # A small layer splits K until the grid covers the GPU, down to one long K step per split.
    small = choose_config(2, 4096, 4096, gpu, packed_words=True)
    assert small.split_k == 4  # 64 tiles x 4 splits (the most a GEMV splits)
    # One row never splits K; byte-wise layers of fewer 16-column tiles than SMs take 8 columns.
    assert (
        choose_config(1, 4096, 4096, gpu).block_n,
        choose_config(1, 4096, 4096, gpu).split_k,
    ) == (16, 1)
    for n, k in ((2048, 4096), (1024, 4096), (512, 2048), (2048, 8192)):
        one_row = choose_config(1, n, k, gpu)
        assert (one_row.path, one_row.block_n, one_row.split_k) == ("gemv", 8, 1), (n, k)
        assert choose_config(1, n, k, gpu, packed_words=True).split_k == 1, (n, k)
    # Several rows on tensor cores: four programs per SM, at most 4 splits (64 tiles of 64
    # columns); 448 tiles of a 28672-row layer split in two.
    for m in (4, 16):
        assert choose_config(m, 4096, 4096, gpu, packed_words=True).split_k == 4
        assert choose_config(m, 6144, 4096, gpu, packed_words=True).split_k == 4
        assert choose_config(m, 28672, 4096, gpu, packed_words=True).split_k == 2
        assert choose_config(m, 28672, 8192, gpu, packed_words=True).split_k == 2
    assert choose_config(16, 57344, 4096, gpu, packed_words=True).split_k == 1  # 896 tiles
    assert choose_config(1, 4096, 4096, gpu, w8a8=True) == choose_config(1, 4096, 4096, gpu)
    assert choose_config(2, 4096, 4096, gpu, w8a8=True).path == "splitk"


def test_one_packed_row_takes_unpipelined_four_row_tiles(h200):
    """One row of packed 4-bit words, every element: 4-row tiles, loads not pipelined (a row
    read as it is keeps its words and activations in registers, and pipelined loads pass them
    through shared memory), two warps over 2048 K where the grid is small."""
    gpu = torch.device("cuda")
    for (n, k), (block_k, warps) in {
        (28672, 8192): (1024, 1),
        (28672, 4096): (1024, 1),
        (6144, 4096): (1024, 1),  # 1536 programs: more than 8 per SM
        (4096, 4096): (2048, 2),
        (4096, 14336): (2048, 2),
    }.items():
        for int4 in (False, True):
            cfg = choose_config(1, n, k, gpu, packed_words=True, int4=int4)
            assert (cfg.path, cfg.block_n, cfg.num_stages, cfg.split_k) == ("gemv", 4, 1, 1)
            assert (cfg.block_k, cfg.num_warps) == (block_k, warps), (n, k, int4)


def test_plans_and_sibling_launches_take_the_dispatchers_one_row_tile(h200):
    """A plan's one-row launch and the sibling launch of its weights use the tile the
    dispatcher chooses for one row on this GPU."""
    from qlens.kernels.dispatch import default_config
    from qlens.kernels.plan import LinearPlan
    from qlens.quant.quantize import quantize_weight

    gpu = torch.device("cuda")
    weight = torch.randn(256, 256)
    for scheme in ("mxfp4", "nvfp4", "int4"):
        payload = quantize_weight(weight, scheme)
        launch = default_config(payload, 1, gpu)
        assert (launch.block_n, launch.num_stages) == (4, 1), scheme
        plan = LinearPlan(payload, torch.device("cpu"), route="kernel")
        plan.device = gpu  # the CPU weight stands in for the GPU's
        assert plan.config(1) == launch, scheme
    from qlens.kernels.sibling_gemv import sibling_gemv
    from qlens.kernels.weights import kernel_weight

    views = [kernel_weight(quantize_weight(torch.randn(n, 256), "mxfp4")) for n in (256, 64)]
    launch = sibling_gemv(views, torch.bfloat16, False, gpu)
    assert not isinstance(launch, str), launch
    assert (launch.config.block_n, launch.config.num_stages) == (4, 1)


def test_table_choices_are_kept_per_gpu(h200, monkeypatch):
    """A repeated shape gets the kept launch back; another GPU (name or SM count) its own."""
    configs = h200
    gpu = torch.device("cuda")
    kept = choose_config(1, 4096, 4096, gpu, packed_words=True)
    assert choose_config(1, 4096, 4096, gpu, packed_words=True) is kept
    monkeypatch.setattr(configs, "gpu_name", lambda device: "NVIDIA A100-SXM4-80GB")
    other = choose_config(1, 4096, 4096, gpu, packed_words=True)
    assert (kept.block_n, kept.block_k) == (4, 2048) and (other.block_n, other.block_k) == (64, 128)
    # 16 split-K tiles: split until about two programs per SM.
    assert choose_config(2, 1024, 4096, gpu).split_k == 16
    monkeypatch.setattr(configs, "sm_count", lambda device: 16)
    assert choose_config(2, 1024, 4096, gpu).split_k == 2


@pytest.mark.parametrize(
    "name, tuned",
    [
        ("NVIDIA H200", True),
        ("NVIDIA H100 80GB HBM3", True),
        ("NVIDIA H100 PCIe", True),
        ("NVIDIA GH200 480GB", True),
        ("NVIDIA H800", True),
        ("NVIDIA H20", True),
        ("NVIDIA A100-SXM4-80GB", False),
        ("NVIDIA L40S", False),
        ("NVIDIA RTX 6000 Ada Generation", False),
    ],
)
def test_hopper_gpus_take_the_tables_tuned_on_the_h200(h200, monkeypatch, name, tuned):
    """Every Hopper GPU gets the H200's launches; others the safe defaults."""
    configs = h200
    gpu = torch.device("cuda")
    tuned_launch = choose_config(1, 28672, 8192, gpu, packed_words=True)
    monkeypatch.setattr(configs, "gpu_name", lambda device: name)
    launch = choose_config(1, 28672, 8192, gpu, packed_words=True)
    assert configs.hopper(name) is tuned
    assert (launch == tuned_launch) is tuned
