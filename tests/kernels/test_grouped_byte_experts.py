"""One-byte experts (fp8-block, MXFP8, int8) in the grouped experts GEMM, in Triton's
interpreter, against ``reference_linear`` on each expert's rows.

Error bound, from the arithmetic: both sides decode every weight exactly as the codec does
(the same float32 products of code and scale), so they differ only by rounding. With float32
activations both sum the same K products in float32 in different orders: each sum is within
``K * 2**-24`` of ``S = |x| @ |W_e|.T + |bias_e|``, so ``|out - ref| <= 2 (K + 1) 2**-24 S``.
bf16 activations add, on the kernel's side, the decoded weight rounded to bf16 for the dot
(``2**-9 S``) and on both the output's rounding to bf16 (``2**-9 |ref|`` each, ``2**-8`` in
all, with ``|out| <= |ref| + ...`` absorbed by the factor 2 below).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    count_grouped_launches,
    record_grouped_launches_without_host_reads,
    rel_err,
)

import qlens.kernels.experts as experts_module
import qlens.kernels.grouped_experts as grouped_module
from qlens.kernels import experts_linear, reference_linear
from qlens.kernels.configs import LinearConfig
from qlens.kernels.experts import expert_views, stacked_experts
from qlens.kernels.grouped_experts import grouped_config, grouped_experts_linear
from qlens.quant.dequantize import dequantize
from qlens.quant.quantize import quantize_weight

BYTE_SCHEMES = (
    ("fp8-block", {}),
    ("fp8-block", {"block_size": (32, 64), "scale_dtype": "e8m0"}),
    ("mxfp8", {}),
    ("int8", {}),
    ("int8", {"group_size": 32, "asymmetric": True, "scale_dtype": "bf16"}),
)


def _scheme_id(scheme) -> str:
    return scheme[0] + "".join(f"-{v}" for v in scheme[1].values())


def _check(out, x, payload, ids, bias) -> None:
    """``out`` against ``reference_linear`` on each expert's rows, within the module's bound."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], payload.shape[1])
    views, weights = expert_views(payload), dequantize(payload, torch.float32).abs()
    k = x.shape[1]
    for expert in torch.unique(ids).tolist():
        rows = torch.nonzero(ids == expert).squeeze(1)
        b = None if bias is None else bias[expert]
        ref = reference_linear(x[rows], views[expert], b).double()
        size = x[rows].double().abs() @ weights[expert].double().T
        if b is not None:
            size = size + b.double().abs()
        bound = 2 * (k + 1) * 2.0**-24 * size
        if x.dtype == torch.bfloat16:
            bound = bound + 2.0**-9 * size + 2 * 2.0**-8 * ref.abs()
        err = (out[rows].double() - ref).abs()
        assert bool((err <= bound).all()), (expert, (err - bound).max().item())


def _routes(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    """(ids, experts): one row, decode rows, and at prefill row counts unused experts (2 and 4
    get no row) and one expert taking every row (every expert in use: the hypothesis test)."""
    some = torch.tensor([0, 1, 3, 5])[torch.randint(0, 4, (77,), generator=gen)]
    return {
        "one row": (torch.tensor([3]), 6),
        "decode rows": (torch.tensor([5, 0, 5, 3, 1, 0, 5, 3]), 6),
        "unused experts": (some, 6),
        "one expert": (torch.full((70,), 4), 6),
    }


@pytest.mark.parametrize("scheme", [s for s in BYTE_SCHEMES if s != ("int8", {})], ids=_scheme_id)
def test_byte_experts_take_one_grouped_launch_at_every_row_count(scheme, monkeypatch):
    """N (136) and K (200) not multiples of 128 or of the tiles, float32 with bias and bf16
    without: one grouped launch a call, from one row to prefill rows (more than
    FUSED_EXPERT_ROWS), and no expert loop."""
    launches = count_grouped_launches(monkeypatch)
    monkeypatch.setattr(experts_module, "quantized_linear", None)  # no per-expert launches
    gen = torch.Generator().manual_seed(0)
    calls = 0
    name, options = scheme
    for ids, experts in _routes(gen).values():
        payload = quantize_weight(torch.randn(experts, 136, 200, generator=gen), name, **options)
        bias = torch.randn(experts, 136, generator=gen)
        for dtype, b in ((torch.float32, bias), (torch.bfloat16, None)):
            x = torch.randn(ids.numel(), 200, generator=gen).to(dtype)
            out = experts_linear(x, payload, ids, b, ids_in_range=True)
            calls += 1
            _check(out, x, payload, ids, b)
    assert len(launches) == calls


def test_byte_experts_leave_rows_of_other_ids_unread_and_the_rest_exact():
    """Ids outside ``[0, experts)`` (the caller vouched for them) sort outside every expert's
    rows: no tile reads them and the other rows keep the bound."""
    gen = torch.Generator().manual_seed(1)
    payload = quantize_weight(torch.randn(4, 24, 64, generator=gen), "fp8-block")
    ids = torch.randint(0, 4, (12,), generator=gen)
    ids[torch.tensor([0, 7])] = torch.tensor([-1, 4])
    x = torch.randn(12, 64, generator=gen)
    out = experts_linear(x, payload, ids, ids_in_range=True)
    inside = (ids >= 0) & (ids < 4)
    _check(out[inside], x[inside], payload, ids[inside], None)


def test_byte_experts_launch_once_with_no_host_read(monkeypatch):
    """Decode and prefill rows of fp8-block experts read nothing on the host: every way a
    tensor's value reaches Python raises during the call; the recorded launch, run afterwards,
    gives the whole result. The grid is sized from the row count alone."""
    gen = torch.Generator().manual_seed(2)
    payload = quantize_weight(torch.randn(8, 40, 160, generator=gen), "fp8-block")
    for rows in (3, 100):
        ids = torch.randint(0, 8, (rows,), generator=gen)
        x = torch.randn(rows, 160, generator=gen)
        with monkeypatch.context() as patch:
            recorded = record_grouped_launches_without_host_reads(patch)
            out = experts_linear(x, payload, ids, ids_in_range=True)
        assert len(recorded) == 1
        (grid, *args), options = recorded[0]
        cfg = grouped_config(rows, 8, 40)
        assert grid == (-(-rows // cfg.block_m) + min(8, rows), 1, 1)  # one column tile (40)
        assert options["PACKED"] is False and options["GROUP_N"] == 128
        grouped_module.GROUPED_EXPERTS.launch(grid, *args, **options)
        _check(out, x, payload, ids, None)


@pytest.mark.parametrize("scheme", BYTE_SCHEMES[1:3], ids=_scheme_id)
def test_byte_experts_tiles_of_the_gpu_config_cover_every_row(scheme, monkeypatch):
    """The GPU's 64-element K steps (shorter than fp8-block's 128-wide scale blocks, two MXFP8
    groups each) with a masked K tail, and tiles smaller than an expert's rows, which the
    interpreter's default config does not take."""
    gen = torch.Generator().manual_seed(6)
    name, options = scheme
    payload = quantize_weight(torch.randn(4, 40, 200, generator=gen), name, **options)
    ids = torch.tensor([2] * 37 + [0] * 16 + [3] * 1 + [2] * 5)[torch.randperm(59, generator=gen)]
    x, bias = torch.randn(59, 200, generator=gen), torch.randn(4, 40, generator=gen)
    w, rows = stacked_experts(payload, ids)
    with monkeypatch.context() as patch:
        patch.setattr(grouped_module, "interpreting", lambda: False)  # the GPU's config
        assert grouped_config(8192, 64, 1536, packed=False).block_k == 64
        assert grouped_config(8192, 64, 1536).block_k == 128
    for cfg in (LinearConfig("gemm", 16, 32, 64, num_stages=1), LinearConfig("gemm", 32, 16, 64)):
        _check(grouped_experts_linear(x, w, rows, 4, bias, cfg), x, payload, ids, bias)


def test_stacked_byte_experts_stride_by_whole_experts():
    payload = quantize_weight(torch.randn(3, 136, 200), "fp8-block")
    w, rows = stacked_experts(payload, torch.tensor([2, 0]))
    assert (w.n, w.k, w.group_n, w.group_k) == (136, 200, 128, 128)
    assert (rows.data, rows.scales, rows.global_scale) == (136 * 200, 2 * 2, 0)
    assert rows.ids.dtype == torch.int32


@pytest.mark.parametrize("scheme", ["fp8-block", "int8"])
def test_the_experts_op_takes_the_grouped_launch_for_byte_experts(scheme, monkeypatch):
    """``torch.ops.qlens.experts_linear`` (what a compiled forward calls) on decode rows of
    one-byte experts (forced onto the one-launch path: the interpreter stands in for the
    accelerator) takes one grouped launch, keeps the bound and passes opcheck; fp8 payloads
    skip opcheck's schema test, whose input comparison CPU torch lacks for float8 tensors."""
    from qlens.kernels import ops
    from qlens.quant.payload_spec import PayloadSpec

    launches = count_grouped_launches(monkeypatch)
    monkeypatch.setattr(experts_module, "experts_in_one_launch", lambda *args: True)
    gen = torch.Generator().manual_seed(5)
    payload = quantize_weight(torch.randn(3, 40, 64, generator=gen), scheme)
    tensors, key = list(payload.tensors().values()), PayloadSpec.of(payload).key
    ids = torch.tensor([2, 0, 2, 2])
    x, bias = torch.randn(4, 64, generator=gen), torch.randn(3, 40, generator=gen)
    out = torch.ops.qlens.experts_linear(x, ids, tensors, key, bias)
    assert len(launches) == 1
    _check(out, x, payload, ids, bias)
    checks = ["test_schema", "test_autograd_registration", "test_faketensor"]
    checks += ["test_aot_dispatch_dynamic"]
    if scheme == "fp8-block":
        checks.remove("test_schema")
    torch.library.opcheck(ops.experts_linear_op, (x, ids, tensors, key, bias), test_utils=checks)
    assert len(launches) > 1


@settings(max_examples=12, deadline=None)
@given(
    experts=st.integers(1, 6),
    rows=st.integers(1, 100),
    n=st.integers(1, 150),
    k=st.integers(1, 260),
    scheme=st.sampled_from(BYTE_SCHEMES),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_byte_experts_routings_and_shapes_keep_the_bound(
    experts, rows, n, k, scheme, dtype, with_bias, seed
):
    """Any expert count, row count (decode and prefill), output width and K, with ids drawn
    from a skewed distribution over the experts (some get no row)."""
    gen = torch.Generator().manual_seed(seed)
    name, options = scheme
    payload = quantize_weight(torch.randn(experts, n, k, generator=gen), name, **options)
    share = torch.rand(experts, generator=gen) ** 4
    ids = torch.multinomial(share + 1e-3, rows, replacement=True, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(experts, n, generator=gen).to(dtype) if with_bias else None
    out = experts_linear(x, payload, ids, bias, ids_in_range=True)
    _check(out, x, payload, ids, bias)


def test_decode_rows_reuse_the_launch_the_plan_built(monkeypatch):
    """Rows of one-byte experts take the grouped launch the experts' plan built once for that
    row count, dtype and bias (checks and launch arguments not redone per call), decode and
    prefill row counts alike."""
    built = []
    real = grouped_module.GroupedExperts
    monkeypatch.setattr(
        grouped_module, "GroupedExperts", lambda *a, **kw: built.append(a[3]) or real(*a, **kw)
    )
    gen = torch.Generator().manual_seed(7)
    payload = quantize_weight(torch.randn(4, 24, 64, generator=gen), "mxfp8")
    for rows in (3, 3, 5, 3, 70, 70):
        ids = torch.randint(0, 4, (rows,), generator=gen)
        x = torch.randn(rows, 64, generator=gen)
        _check(experts_linear(x, payload, ids, ids_in_range=True), x, payload, ids, None)
    assert built == [3, 5, 70]


def test_the_one_launch_paths_build_no_per_expert_views(monkeypatch):
    """A compiled forward rebuilds the payload (and its plan) on every call: the one-launch
    paths read the first expert's view only, never one view per expert."""
    selected = []
    real = experts_module.select_expert
    monkeypatch.setattr(
        experts_module, "select_expert", lambda p, e: selected.append(e) or real(p, e)
    )
    gen = torch.Generator().manual_seed(8)
    payload = quantize_weight(torch.randn(6, 24, 64, generator=gen), "fp8-block")
    calls = []
    for rows in (3, 70):
        ids = torch.randint(0, 6, (rows,), generator=gen)
        x = torch.randn(rows, 64, generator=gen)
        calls.append((experts_linear(x, payload, ids, ids_in_range=True), x, ids))
    assert selected == [0]
    for out, x, ids in calls:
        _check(out, x, payload, ids, None)


def test_the_plan_runs_strided_rows_of_byte_experts():
    """``ExpertsPlan.rows`` (what the modules call) takes rows of any layout, as the packed
    GEMV does: a column slice of a wider activation gives the same result as its copy."""
    from qlens.kernels.experts import experts_plan_for

    gen = torch.Generator().manual_seed(9)
    payload = quantize_weight(torch.randn(4, 24, 64, generator=gen), "int8", group_size=32)
    wide = torch.randn(5, 128, generator=gen)
    ids = torch.tensor([3, 0, 3, 1, 2])
    plan = experts_plan_for(payload, wide.device)
    strided = plan.rows(wide[:, 32:96], ids, None)
    assert torch.equal(strided, plan.rows(wide[:, 32:96].contiguous(), ids, None))
    _check(strided, wide[:, 32:96].contiguous(), payload, ids, None)


def test_a_block_of_byte_experts_sorts_its_rows_once(monkeypatch):
    """A QuantExperts forward of fp8-block experts sorts the routed rows once for both
    projections' grouped launches (a masked route among them), and matches the same module
    run expert by expert."""
    import qlens.modules.dispatch as dispatch_module
    from qlens.kernels.experts import ExpertsPlan
    from qlens.modules import ExpertGate, QuantExperts

    gen = torch.Generator().manual_seed(8)
    num_experts, hidden_size, inner, tokens, top_k = 4, 128, 128, 6, 2
    experts = QuantExperts(
        quantize_weight(
            torch.randn(num_experts, 2 * inner, hidden_size, generator=gen), "fp8-block"
        ),
        quantize_weight(torch.randn(num_experts, hidden_size, inner, generator=gen), "fp8-block"),
        ExpertGate("stacked", "silu"),
    )
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weights, index = torch.softmax(torch.randn(tokens, num_experts, generator=gen), -1).topk(top_k)
    index[2, 1] = num_experts  # a masked route (Mixtral's id == num_experts) is skipped
    with torch.no_grad():
        loop = experts(hidden, index, weights)
        sorts = []
        for module in (dispatch_module, grouped_module):
            real = module.sort_by_expert
            monkeypatch.setattr(
                module,
                "sort_by_expert",
                lambda *args, real=real, **kwargs: sorts.append(args[1]) or real(*args, **kwargs),
            )
        launches = count_grouped_launches(monkeypatch)
        monkeypatch.setattr(ExpertsPlan, "one_launch", lambda self, rows: True)
        grouped = experts(hidden, index, weights)
    assert sorts == [num_experts] and len(launches) == 2
    assert rel_err(grouped, loop) < 1e-5


def test_the_plan_names_the_grouped_launch_a_block_can_sort_for():
    """``ExpertsPlan.grouped``: the kept grouped launch for one-byte experts at any row count
    and packed 4-bit experts past the GEMV's rows; ``None`` where the word-wise GEMV runs."""
    from qlens.kernels.experts import FUSED_EXPERT_ROWS, ExpertsPlan
    from qlens.kernels.grouped_experts import GroupedExperts

    gen = torch.Generator().manual_seed(9)
    cpu = torch.device("cpu")
    byte = ExpertsPlan(quantize_weight(torch.randn(4, 24, 128, generator=gen), "fp8-block"), cpu)
    packed = ExpertsPlan(quantize_weight(torch.randn(4, 24, 64, generator=gen), "int4"), cpu)
    launch = byte.grouped(3, torch.float32, True)
    assert isinstance(launch, GroupedExperts)
    assert byte.grouped(3, torch.float32, True) is launch  # kept
    assert packed.grouped(FUSED_EXPERT_ROWS, torch.float32, True) is None
    assert isinstance(packed.grouped(FUSED_EXPERT_ROWS + 1, torch.float32, True), GroupedExperts)
