"""The grouped experts GEMM (prefill) in Triton's interpreter against a float64 reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    count_grouped_launches,
    record_grouped_launches_without_host_reads,
    rel_err,
)

import qlens.kernels.grouped_experts as grouped_module
from qlens.kernels import experts_linear
from qlens.kernels.configs import LinearConfig
from qlens.kernels.experts import FUSED_EXPERT_ROWS, stacked_experts
from qlens.kernels.grouped_experts import (
    grouped_config,
    grouped_experts_linear,
)
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

SCHEMES = (
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("int4", {}),
    ("int4", {"group_size": 32, "asymmetric": True}),
    ("int4", {"group_size": 64, "scale_dtype": "bf16"}),
)
# float32: exact decodes and IEEE dots, only the summation order differs from float64 (K <= 320
# terms: far below 1e-6 relative); bf16 and fp16 round the output once (2**-9, 2**-11 relative).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 2e-3}


def _scheme_id(scheme) -> str:
    return scheme[0] + "".join(f"-{v}" for v in scheme[1].values())


def _payloads(scheme, experts: int, n: int, k: int, gen: torch.Generator):
    """The scheme's payload, and for nvfp4 also one with a global scale per expert."""
    name, kwargs = scheme
    payload = quantize_weight(torch.randn(experts, n, k, generator=gen), name, **kwargs)
    if name != "nvfp4":
        return [payload]
    per_expert = payload.global_scale * torch.linspace(0.5, 2, experts)
    return [payload, replace(payload, global_scale=per_expert)]


def _reference(x, payload, ids, bias):
    weights = dequantize(payload, torch.float64)  # [experts, out, in]
    out = torch.einsum("tk,tnk->tn", x.double(), weights[ids])
    return out if bias is None else out + bias.double()[ids]


def _routes(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    """(ids, experts) per routing: unused experts, one expert taking every row, all in use."""
    some = torch.tensor([0, 3, 5])[torch.randint(0, 3, (77,), generator=gen)]
    return {
        "unused experts": (some, 6),
        "one expert": (torch.full((70,), 4), 6),
        "every expert": (torch.randint(0, 5, (90,), generator=gen), 5),
    }


@pytest.mark.parametrize("scheme", SCHEMES, ids=_scheme_id)
def test_grouped_experts_match_the_per_token_reference(scheme, monkeypatch):
    """More than FUSED_EXPERT_ROWS rows take one grouped launch per call and match the float64
    reference for every routing, with and without bias, in float32 and bf16."""
    launches = count_grouped_launches(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    calls = 0
    for label, (ids, experts) in _routes(gen).items():
        assert ids.numel() > FUSED_EXPERT_ROWS
        for payload in _payloads(scheme, experts, 24, 64, gen):
            bias = torch.randn(experts, 24, generator=gen)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(ids.numel(), 64, generator=gen).to(dtype)
                for b in (bias.to(dtype), None):
                    out = experts_linear(x, payload, ids, b, ids_in_range=True)
                    calls += 1
                    assert out.dtype == dtype and out.shape == (ids.numel(), 24)
                    err = rel_err(out, _reference(x, payload, ids, b))
                    assert err < TOLERANCE[dtype], (label, dtype, b is None, err)
    assert len(launches) == calls  # one launch a call, whatever the experts in use


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=_scheme_id)
def test_grouped_experts_tiles_cover_every_row(scheme):
    """Tiles smaller than an expert's rows (rows not a multiple of BLOCK_M), column tiles that
    do not divide N, and K in one full step plus a masked tail."""
    gen = torch.Generator().manual_seed(1)
    experts, n, k = 4, 40, 192
    for payload in _payloads(scheme, experts, n, k, gen):
        ids = torch.tensor([2] * 37 + [0] * 16 + [3] * 1 + [2] * 5)[torch.randperm(59)]
        x = torch.randn(59, k, generator=gen)
        bias = torch.randn(experts, n, generator=gen)
        w, rows = stacked_experts(payload, ids)
        ref = _reference(x, payload, ids, bias)
        for cfg in (
            LinearConfig("gemm", 16, 32, 128, num_stages=1),
            LinearConfig("gemm", 32, 16, 128, num_stages=1),
        ):
            out = grouped_experts_linear(x, w, rows, experts, bias, cfg)
            assert rel_err(out, ref) < TOLERANCE[torch.float32], cfg


def test_grouped_config_fits_the_tile_to_the_rows_per_expert():
    assert grouped_config(8192, 64, 1536).block_m == 64  # 128 rows an expert
    assert grouped_config(8192, 256, 1536).block_m == 32
    assert grouped_config(65, 64, 1536).block_m == 16  # at least 16 rows for the dots
    assert grouped_config(100, 4, 24).block_n == 32  # the interpreter's columns


def test_grouped_experts_launch_once_with_no_host_read(monkeypatch):
    """The grouped path reads nothing on the host: every way a tensor's value reaches Python
    raises during the call; the one recorded launch, run afterwards, gives the whole result.
    The grid is sized from the row count alone."""
    gen = torch.Generator().manual_seed(2)
    payload = quantize_weight(torch.randn(8, 32, 64, generator=gen), "int4", group_size=32)
    ids = torch.randint(0, 8, (100,), generator=gen)
    x = torch.randn(100, 64, generator=gen)
    with monkeypatch.context() as patch:
        recorded = record_grouped_launches_without_host_reads(patch)
        out = experts_linear(x, payload, ids, ids_in_range=True)
    assert len(recorded) == 1
    (grid, *args), options = recorded[0]
    cfg = grouped_config(100, 8, 32)
    assert grid == (-(-100 // cfg.block_m) + 8, 1, 1)  # one column tile (32 columns) a row tile
    grouped_module.GROUPED_EXPERTS.launch(grid, *args, **options)
    assert rel_err(out, _reference(x, payload, ids, None)) < TOLERANCE[torch.float32]


def test_packed_rows_outside_whole_words_keep_the_per_expert_path(monkeypatch):
    for name in ("launch", "prepare"):  # must not be reached
        monkeypatch.setattr(grouped_module.GROUPED_EXPERTS, name, None)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (70,), generator=gen)
    payload = quantize_weight(torch.randn(3, 16, 90, generator=gen), "int4", group_size=32)
    x = torch.randn(70, 90, generator=gen)  # 45 bytes a row
    assert rel_err(experts_linear(x, payload, ids), _reference(x, payload, ids, None)) < 1e-6


def test_grouped_experts_refuse_rows_outside_whole_words():
    from qlens.kernels.experts import first_expert_view
    from qlens.kernels.gemv import ExpertRows

    payload = quantize_weight(torch.randn(3, 16, 90), "int4", group_size=32)  # 45 bytes a row
    view = first_expert_view(payload)
    assert view is not None
    rows = ExpertRows(ids=torch.zeros(70, dtype=torch.int32), data=0, scales=0, global_scale=0)
    with pytest.raises(ValueError, match="whole int32 words, got int4 with 45 bytes a row"):
        grouped_experts_linear(torch.randn(70, 90), view, rows, 3, None)


def test_grouped_experts_reject_bad_inputs(monkeypatch):
    payload = quantize_weight(torch.randn(3, 16, 64), "int4", group_size=32)
    ids = torch.randint(0, 3, (70,))
    x = torch.randn(70, 64)
    with pytest.raises(ValueError, match=r"activations, got torch.float64; cast the input first"):
        experts_linear(x.double(), payload, ids, ids_in_range=True)
    with pytest.raises(ValueError, match=r"bias must have shape \[3, 16\] on cpu, got \[2, 16\]"):
        experts_linear(x, payload, ids, torch.randn(2, 16), ids_in_range=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="Triton kernels need a CUDA device"):
        experts_linear(x, payload, ids, ids_in_range=True)


@settings(max_examples=15)
@given(
    experts=st.integers(1, 9),
    rows=st.integers(FUSED_EXPERT_ROWS + 1, 150),
    n=st.integers(1, 40),
    words=st.integers(1, 40),
    scheme=st.sampled_from(SCHEMES),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_routings_and_shapes_match_reference(
    experts, rows, n, words, scheme, dtype, with_bias, seed
):
    """Any expert count, row count, output width and K in whole words, with ids drawn from a
    random, often skewed, distribution over the experts."""
    gen = torch.Generator().manual_seed(seed)
    k = 8 * words
    payload = _payloads(scheme, experts, n, k, gen)[-1]
    share = torch.rand(experts, generator=gen) ** 4  # some experts get (almost) nothing
    ids = torch.multinomial(share + 1e-3, rows, replacement=True, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(experts, n, generator=gen).to(dtype) if with_bias else None
    assert stacked_experts(payload, ids) is not None  # whole words: the grouped path
    out = experts_linear(x, payload, ids, bias, ids_in_range=True)
    ref = _reference(x, payload, ids, bias)
    if ref.norm() == 0:  # every weight rounded to zero
        assert bool((out == 0).all())
    else:
        assert rel_err(out, ref) < TOLERANCE[dtype]


def test_rows_of_ids_out_of_range_do_not_disturb_the_others():
    """With ``ids_in_range=True`` the caller vouches for the ids; rows of other ids sort before
    or after every expert's rows, so no tile reads them and the other rows stay exact."""
    gen = torch.Generator().manual_seed(4)
    payload = quantize_weight(torch.randn(4, 24, 64, generator=gen), "mxfp4")
    ids = torch.randint(0, 4, (80,), generator=gen)
    outside = torch.tensor([0, 7, 33, 79])
    ids[outside] = torch.tensor([-1, 4, 9, -3])
    x = torch.randn(80, 64, generator=gen)
    out = experts_linear(x, payload, ids, ids_in_range=True)
    inside = torch.ones(80, dtype=torch.bool)
    inside[outside] = False
    ref = _reference(x[inside], payload, ids[inside], None)
    assert rel_err(out[inside], ref) < TOLERANCE[torch.float32]


def test_the_experts_op_takes_the_grouped_launch(monkeypatch):
    """``torch.ops.qlens.experts_linear`` (what a compiled forward calls) on prefill rows takes
    the grouped launch where experts run at once (forced here: the interpreter stands in for the
    accelerator), passes opcheck on that path and matches the reference."""
    import qlens.kernels.experts as experts_module
    from qlens.kernels import ops
    from qlens.quant.payload_spec import PayloadSpec

    launches = count_grouped_launches(monkeypatch)
    monkeypatch.setattr(experts_module, "experts_in_one_launch", lambda *args: True)
    gen = torch.Generator().manual_seed(5)
    # mxfp4: opcheck's schema check cannot compare float8 tensors (nvfp4's scales)
    payload = quantize_weight(torch.randn(3, 40, 64, generator=gen), "mxfp4")
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    ids = torch.randint(0, 3, (70,), generator=gen)
    x, bias = torch.randn(70, 64, generator=gen), torch.randn(3, 40, generator=gen)
    out = torch.ops.qlens.experts_linear(x, ids, tensors, key, bias)
    assert len(launches) == 1
    assert rel_err(out, _reference(x, payload, ids, bias)) < TOLERANCE[torch.float32]
    torch.library.opcheck(ops.experts_linear_op, (x, ids, tensors, key, bias))
    assert len(launches) > 1
