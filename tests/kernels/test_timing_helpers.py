"""The benchmarks' shared launch timer, with graph timing replaced by one plain call (CPU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kernel_cases import quantized

from benchmarks import _timing as timing
from qlens.kernels import LinearConfig, dequantize_triton


def test_time_launches_times_each_launch_and_marks_failures(monkeypatch, capsys):
    calls: list[int] = []

    def one_call(fns, replays=20):
        for fn in fns:
            fn()
        calls.append(len(fns))
        return 2.5

    monkeypatch.setattr(timing, "time_graph", one_call)
    p = quantized(40, 256, ("int4", {"group_size": 64}))
    x = torch.randn(16, 256)
    exact = F.linear(x.double(), dequantize_triton(p, torch.float32).double())
    good = LinearConfig("gemv", 16, 16, 128)
    narrow = LinearConfig("gemv", 16, 4, 128)  # 16 rows need tensor-core tiles of >= 16 columns
    times, worst = timing.time_launches([p, p], x, [good, narrow], exact)
    assert times[0] == 2.5 and math.isnan(times[1])
    assert calls == [2]  # the failing launch raised before its graph was timed
    assert 0 < worst < 1e-6  # fp32 interpreter products of the exact codes
    assert "failed: block_n must be a power of two >= 16" in capsys.readouterr().out


def test_seeded_weight_repeats_and_reseeds():
    w = timing.seeded_weight(6, 10, "cpu")
    after = torch.randn(3)
    torch.manual_seed(0)
    expected = torch.randn(6, 10, dtype=torch.bfloat16) * 0.02
    assert w.dtype == torch.bfloat16 and torch.equal(w, expected)
    assert torch.equal(after, torch.randn(3))  # draws after it repeat too


def test_time_bf16_linear_times_f_linear_on_every_weight(monkeypatch):
    outs: list[torch.Tensor] = []
    monkeypatch.setattr(timing, "time_graph", lambda fns: outs.extend(f() for f in fns) or 1.5)
    weights = [torch.randn(4, 8), torch.randn(4, 8)]
    x = torch.randn(2, 8)
    assert timing.time_bf16_linear(weights, x) == 1.5
    assert [torch.equal(o, F.linear(x, w)) for o, w in zip(outs, weights, strict=True)] == [
        True,
        True,
    ]


def test_launch_sweep_tables_every_layer_row_count_and_scheme(monkeypatch, capsys):
    from qlens.kernels.dispatch import default_config

    timed: list[int] = []

    def one_call(fns, replays=20):
        for fn in fns:
            fn()
        timed.append(len(fns))
        return 4.0 if len(timed) % 2 else 2.0

    monkeypatch.setattr(timing, "time_graph", one_call)
    monkeypatch.setattr(timing, "copies_for", lambda nbytes: 2)  # two copies of each weight
    configs = [LinearConfig("gemv", 16, 16, 128), LinearConfig("gemv", 16, 32, 256, num_warps=8)]
    schemes = [("int4", {"group_size": 64}), ("mxfp4", {})]
    rows = timing.launch_sweep([(48, 256)], (1, 3), schemes, configs, device="cpu")
    assert rows[0].count("|") == 10 + len(configs)
    assert timing.launch_label(configs[1]) == "gemv 16x32x256 w8 st3 s1"
    assert "| gemv 16x16x128 w4 st3 s1 | gemv 16x32x256 w8 st3 s1 |" in rows[0]
    body = [r.split(" | ") for r in rows[2:]]
    assert [(r[0], r[1], r[2]) for r in body] == [
        ("| 48 x 256", "int4 group_size=64", "1"), ("| 48 x 256", "mxfp4", "1"),
        ("| 48 x 256", "int4 group_size=64", "3"), ("| 48 x 256", "mxfp4", "3"),
    ]  # fmt: skip
    from qlens.quant.quantize import quantize_weight

    w = timing.seeded_weight(48, 256, "cpu")
    chosen = default_config(quantize_weight(w, "int4", group_size=64), 3, torch.device("cpu"))
    assert body[2][4] == timing.launch_label(chosen)  # the dispatcher's own launch
    # Per row count: bf16 once, then the dispatcher and each launch per scheme, each over both
    # copies of the weight.
    assert timed == [2] * (2 * (1 + 2 * (1 + len(configs))))
    assert all(float(r[-2].rstrip("x")) > 0 for r in body)
    assert all(float(r[-1].rstrip(" |")) < 1e-2 for r in body)  # vs the fp32 product
    assert capsys.readouterr().out.count("| 48 x 256 |") == 4  # printed as timed


def test_select_schemes_keeps_the_named_schemes_in_order():
    schemes = (*timing.PACKED_4BIT_SCHEMES, ("int4", {"group_size": 128, "asymmetric": True}))
    assert timing.select_schemes(schemes, None) == list(schemes)
    assert timing.select_schemes(schemes, "nvfp4,int4") == [schemes[0], schemes[2], schemes[3]]
    assert timing.select_schemes(schemes, "fp8-block") == []


def test_median_wall_s_warms_up_then_takes_the_median(monkeypatch):
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 25.0])  # runs of 3, 1 and 5 seconds
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls: list[int] = []
    assert timing.median_wall_s(lambda: calls.append(1), repeats=3, warmup=2) == 3.0
    assert len(calls) == 5


def test_header_names_the_device_and_the_libraries(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = timing.header("T", "timed so", ["transformers"])
    import transformers

    assert text.startswith("# T\n")
    assert "- GPU: none: CPU " in text and "- timing: timed so" in text
    assert f", transformers {transformers.__version__}\n" in text


def test_result_files_are_named_after_the_gpu_that_ran():
    assert timing.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert timing.gpu_tag("NVIDIA H200") == "h200"
    assert timing.gpu_tag("NVIDIA GH200 480GB") == "gh200"
    assert timing.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert timing.gpu_tag("NVIDIA L40S") == "l40s"
    assert timing.gpu_tag("Some Future Accelerator") == "gpu"
    assert timing.result_filename("gemv_tiles_h200.md", "NVIDIA H100 80GB HBM3") == (
        "gemv_tiles_h100.md"
    )
    assert timing.result_filename("gemv_tiles_h200.md", "NVIDIA H200") == "gemv_tiles_h200.md"
    assert timing.result_filename("compiled_decode_8b.md", "NVIDIA H100") == "compiled_decode_8b.md"


def test_gemv_tiles_reads_the_launches_it_is_given():
    from benchmarks.tuning.gemv_tiles import CONFIGS, chosen_launches

    assert chosen_launches(None) == CONFIGS
    assert chosen_launches("8x1024w1st3,16x512w2st1") == (
        LinearConfig("gemv", 16, 8, 1024, num_warps=1, num_stages=3),
        LinearConfig("gemv", 16, 16, 512, num_warps=2, num_stages=1),
    )


def test_sass_loops_counts_the_body_of_each_backward_branch():
    from benchmarks._sm90 import sass_loops

    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, [R2.64] ;
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/                   LOP3.LUT R9, R4, 0xf, RZ, 0xc0, !PT ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   STG.E [R2.64], R8 ;
        /*0060*/                   BRA 0x60 ;
    """
    # the branch to itself ending every kernel is not a loop
    assert sass_loops(listing) == [{"LDG.E.128": 1, "FFMA": 1, "LOP3.LUT": 1, "BRA": 1}]
