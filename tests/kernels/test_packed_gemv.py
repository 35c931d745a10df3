"""The packed 4-bit GEMV: its integer decodes, the activation regrouping and the kernel itself
(Triton interpreter) against the codecs' dequantization."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import quantized, rel_err

from qlens.kernels import LinearConfig, gemv, packed_gemv, quantized_linear, splits
from qlens.kernels.code_order import permute_codes
from qlens.kernels.dispatch import default_config
from qlens.kernels.gemv import word_view
from qlens.kernels.packed_gemv import (
    E2M1_FP16_FACTOR,
    E2M1_MAGNITUDE_MASK,
    E2M1_PAIR_SHIFTS,
    E2M1_SIGN_MASK,
    INT4_MAGIC_BITS,
    e2m1_word_asm,
)
from qlens.kernels.weights import kernel_weight
from qlens.quant.codecs.elements import decode_e2m1
from qlens.quant.dequantize import dequantize

TOLERANCE = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 1e-6}
FAMILIES = (
    ("int4", {"group_size": 32}),
    ("int4", {"group_size": 128, "asymmetric": True, "scale_dtype": "bf16"}),
    ("mxfp4", {}),
    ("nvfp4", {}),
)
WORD_MASK = 0xFFFFFFFF


def _words_with_every_code() -> torch.Tensor:
    """int64 words (as unsigned 32-bit values) putting each of the 16 codes at each position."""
    codes = torch.arange(16, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for j in range(8):
        other = torch.randint(0, 1 << 32, (16,), generator=gen, dtype=torch.int64)
        rows.append((other & ~(0xF << (4 * j)) & WORD_MASK) | (codes << (4 * j)))
    return torch.cat(rows)


def _shift(w: torch.Tensor, amount: int) -> torch.Tensor:
    return ((w << amount) if amount >= 0 else (w >> -amount)) & WORD_MASK


def _fp16_bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.float16).float()


def test_e2m1_word_decode_emulated_bit_for_bit():
    """The asm's integer ops, run in torch, give every code's E2M1 value at every position."""
    words = _words_with_every_code()
    for p, (mag_shift, sign_shift) in enumerate(E2M1_PAIR_SHIFTS):
        pair = (_shift(words, mag_shift) & E2M1_MAGNITUDE_MASK) | (
            _shift(words, sign_shift) & E2M1_SIGN_MASK
        )
        for half, j in ((0, p), (1, p + 4)):
            bits = (pair >> (16 * half)) & 0xFFFF
            bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # as signed int16
            got = _fp16_bits_to_f32(bits) * E2M1_FP16_FACTOR
            want = decode_e2m1(((words >> (4 * j)) & 0xF).to(torch.uint8))
            assert torch.equal(got, want), (p, j)


def test_e2m1_asm_is_generated_from_the_emulated_constants():
    asm = e2m1_word_asm()
    shifts = [int(a) * (-1 if op == "shr.u32" else 1) for op, a in
              re.findall(r"(shl\.b32|shr\.u32) [ab], \$8, (\d+);", asm)]  # fmt: skip
    assert shifts == [s for pair in E2M1_PAIR_SHIFTS for s in pair]
    assert asm.count(f"{E2M1_MAGNITUDE_MASK:#010x}") == 4
    assert asm.count(f"{E2M1_SIGN_MASK:#010x}") == 4
    outputs = sorted(int(d) for d in re.findall(r"cvt\.f32\.f16 \$(\d),", asm))
    assert outputs == list(range(8))


def test_int4_magic_decode_emulated_exactly():
    """``(marked & (magic | 0xF << 4j')) as float * 16**-j' - (2**(23 - 4j') + zero)``."""
    words = _words_with_every_code()
    marked = (words | INT4_MAGIC_BITS, (words >> 16) | INT4_MAGIC_BITS)
    for zero in (8.0, 0.0, 15.0):
        for j in range(8):
            jp = j % 4
            field = marked[j // 4] & (INT4_MAGIC_BITS | (0xF << (4 * jp)))
            value = field.to(torch.int32).view(torch.float32)
            # float64 holds the FMA's exact product and sum; the result must need no rounding
            got = value.double() * 16.0**-jp - (2.0 ** (23 - 4 * jp) + zero)
            want = ((words >> (4 * j)) & 0xF).double() - zero
            assert torch.equal(got, want), (zero, j)
            assert torch.equal(got.float().double(), got)


def test_permute_codes_layout():
    x = torch.randn(3, 77)
    out = permute_codes(x)
    assert out.shape == (3, 8, 12) and out.dtype == torch.float32  # 10 words padded to 12
    assert out.is_contiguous()
    padded = F.pad(x, (0, 96 - 77))
    for j, w in ((0, 0), (5, 7), (7, 11), (4, 9)):
        assert torch.equal(out[:, j, w], padded[:, 8 * w + j])
    assert torch.equal(out[:, :, 10:], torch.zeros(3, 8, 2))  # the padding words
    half = permute_codes(x.bfloat16())
    assert half.dtype == torch.bfloat16 and torch.equal(half, out.bfloat16())


def _reference(x, payload, bias=None):
    weight = dequantize(payload, torch.float64)
    return F.linear(x.double(), weight, None if bias is None else bias.double())


@pytest.mark.parametrize("case", FAMILIES, ids=lambda c: c[0] + "-" + "-".join(map(str, c[1])))
def test_packed_gemv_matches_reference(case):
    # K = 328: one or five full tiles plus a ragged tail; N = 40: a partial N tile. One row
    # reads x as it is; more rows regroup it for the tensor-core dots.
    payload = quantized(40, 328, case)
    view = kernel_weight(payload)
    assert word_view(view) is not None  # the word-wise kernel serves it
    bias = torch.randn(40)
    for m, split, block_n, block_k in (
        (1, 1, 32, 256), (1, 2, 4, 64), (1, 1, 8, 128), (1, 1, 8, 512), (3, 1, 32, 64),
        (5, 2, 32, 64), (17, 1, 32, 256),
    ):  # fmt: skip
        x = torch.randn(m, 328)
        cfg = LinearConfig("gemv", 16, block_n, block_k, split_k=split)
        out = gemv.prepare_gemv(view, m, x.dtype, True, cfg)(x, bias)
        assert rel_err(out, _reference(x, payload, bias)) < TOLERANCE[torch.float32], m


@pytest.mark.parametrize(
    "case",
    (*FAMILIES, ("int4", {"group_size": 16, "asymmetric": True})),
    ids=lambda c: c[0] + "-" + "-".join(map(str, c[1])),
)
def test_both_quad_arrangements_sum_alike(case, monkeypatch):
    """Both arrangements of the quad tiles (the one each Triton version's coalescing keeps in
    registers, ``quads_lead``) give the same result bit for bit, over full tiles, a ragged K
    tail, a partial N tile and K splits; groups span quads (32-128) or pairs of words (16, with
    zero points)."""
    import triton.language as tl

    payload = quantized(40, 296, case)  # K: two 128-groups and a ragged tail of 40
    view = kernel_weight(payload)
    x, bias = torch.randn(1, 296), torch.randn(40)
    for split, block_n, block_k in ((1, 8, 256), (1, 4, 128), (2, 8, 128), (1, 16, 64)):
        cfg = LinearConfig("gemv", 16, block_n, block_k, split_k=split)
        outs = []
        for lead in (True, False):
            monkeypatch.setattr(packed_gemv, "QUADS_LEAD", tl.constexpr(lead))
            outs.append(gemv.PackedGemv(view, word_view(view), 1, x.dtype, True, cfg)(x, bias))
        assert torch.equal(outs[0], outs[1]), (split, block_n, block_k)
        assert rel_err(outs[0], _reference(x, payload, bias)) < TOLERANCE[torch.float32]


def test_quads_lead_up_to_triton_3_6_only():
    assert packed_gemv.quads_lead("3.6.0") and packed_gemv.quads_lead("3.5.1")
    assert not packed_gemv.quads_lead("3.7.1")
    assert not packed_gemv.quads_lead("3.9.0+git1234")
    assert not packed_gemv.quads_lead("4.0.0")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c[0] + "-" + "-".join(map(str, c[1])))
def test_rows_read_as_they_are_give_the_regrouped_rows_products(family, monkeypatch):
    """``x_as_is``: rows on tensor cores split by code position in the kernel's registers,
    with no copy before the launch, give what the regrouped rows give, bit for bit (the same
    products, summed in the same order), over K tails (296 = 2 x 128 + 40), K splits and a
    partial tile of rows; float32 and bf16 rows."""
    payload = quantized(40, 296, family)
    view = kernel_weight(payload)
    regrouped: list[int] = []
    permute = gemv.permute_codes
    monkeypatch.setattr(gemv, "permute_codes", lambda x: regrouped.append(1) or permute(x))
    bias = torch.randn(40)
    for dtype in (torch.float32, torch.bfloat16):
        for m, split, block_k in ((3, 1, 128), (16, 2, 256), (20, 3, 64)):
            x = torch.randn(m, 296).to(dtype)
            outs = []
            for as_is in (False, True):
                cfg = LinearConfig("gemv", 16, 16, block_k, split_k=split, x_as_is=as_is)
                regrouped.clear()
                outs.append(gemv.PackedGemv(view, word_view(view), m, dtype, True, cfg)(x, bias))
                assert len(regrouped) == (0 if as_is else 1)
            assert torch.equal(outs[0], outs[1]), (dtype, m, split, block_k)
            assert rel_err(outs[1], _reference(x, payload, bias)) < TOLERANCE[dtype]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c[0] + "-" + "-".join(map(str, c[1])))
def test_k_splits_summed_in_the_kernel_give_the_reducing_launchs_output(family, monkeypatch):
    """``split_sum``: tensor-core launches split along K sum their partials in the kernel (the
    last program of each tile, in split order), bit for bit as the reducing launch does, in
    one launch a call, and leave their tile counters at zero; rows as they are and
    regrouped, bias or none, a partial tile of rows, float32 and bf16."""
    payload = quantized(40, 296, family)
    view = kernel_weight(payload)
    launched: list[str] = []
    for name in ("PACKED_GEMV",):
        launcher = getattr(gemv, name)
        monkeypatch.setattr(launcher, "launch", _counting(launcher.launch, launched, name))
    reduce = splits._REDUCE
    monkeypatch.setattr(reduce, "launch", _counting(reduce.launch, launched, "reduce"))
    prepared_call = splits.PreparedLaunch.__call__
    monkeypatch.setattr(
        splits.PreparedLaunch,
        "__call__",
        lambda self, *t: launched.append(self.launcher.kernel.__name__) or prepared_call(self, *t),
    )
    for dtype in (torch.float32, torch.bfloat16):
        for m, split, as_is, bias in ((16, 2, True, None), (20, 3, False, torch.randn(40))):
            x = torch.randn(m, 296).to(dtype)
            outs = {}
            for summed in (False, True):
                cfg = LinearConfig(
                    "gemv", 16, 16, 64, split_k=split, x_as_is=as_is, split_sum=summed
                )
                launch = gemv.PackedGemv(view, word_view(view), m, dtype, bias is not None, cfg)
                assert (launch.reduce is None) == summed and bool(launch.counters) == summed
                launched.clear()
                outs[summed] = launch(x, bias)
                kernels = ["packed_gemv_kernel"] + ([] if summed else ["_reduce_splits_kernel"])
                assert launched == kernels, (summed, launched)
            assert torch.equal(outs[True], outs[False]), (dtype, m, split, as_is)
            assert rel_err(outs[True], _reference(x, payload, bias)) < TOLERANCE[dtype]
    counters = splits.split_counters(torch.device("cpu"), 1)
    assert counters.dtype == torch.int32 and not counters.any()


def test_by_default_eager_calls_sum_their_splits_and_graph_captures_reduce_them(monkeypatch):
    """``split_sum=None`` (the default) with rows read as they are outside CUDA-graph capture
    (``x_as_is=None``): the first call (regrouped, compiling that launch) and calls while a
    graph captures take the regrouped launch and the reducing one; other calls one launch that
    sums its splits; all bit for bit the same."""
    payload = quantized(40, 296, ("nvfp4", {}))
    view = kernel_weight(payload)
    launched: list[str] = []
    prepared_call = splits.PreparedLaunch.__call__
    monkeypatch.setattr(
        splits.PreparedLaunch,
        "__call__",
        lambda self, *t: launched.append(self.launcher.kernel.__name__) or prepared_call(self, *t),
    )
    capturing = [False]
    monkeypatch.setattr(gemv, "capturing_cuda_graph", lambda device: capturing[0])
    cfg = LinearConfig("gemv", 16, 16, 64, split_k=3)
    launch = gemv.PackedGemv(view, word_view(view), 20, torch.bfloat16, False, cfg)
    x = torch.randn(20, 296).to(torch.bfloat16)
    outs = []
    for capture in (False, False, True, False):
        capturing[0] = capture
        launched.clear()
        outs.append(launch(x, None))
        regrouped = capture or len(outs) == 1
        want = (
            ["packed_gemv_kernel", "_reduce_splits_kernel"] if regrouped else ["packed_gemv_kernel"]
        )
        assert launched == want, (len(outs), launched)
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert rel_err(outs[0], _reference(x, payload, None)) < TOLERANCE[torch.bfloat16]
    assert not splits.split_counters(torch.device("cpu"), 1).any()


def test_one_row_and_unsplit_launches_keep_no_tile_counters():
    """Only tensor-core launches split along K count their tiles (when ``split_sum`` asks, or
    by default for the launch on rows as they are): one row (FMAs) and unsplit launches have
    no counters, and an unsplit launch no reduction either; by default a split launch keeps
    both, the reduction for its regrouped launch."""
    assert LinearConfig("gemv", 16, 16, 64).split_sum is None
    view = kernel_weight(quantized(40, 256, ("int4", {"group_size": 64})))
    split = LinearConfig("gemv", 16, 16, 64, split_k=2, split_sum=True)
    unsplit = LinearConfig("gemv", 16, 16, 64, split_sum=True)
    by_default = LinearConfig("gemv", 16, 16, 64, split_k=2)
    for m, cfg, counters, reduce in (
        (1, split, 0, True),
        (1, by_default, 0, True),
        (5, unsplit, 0, False),
        (5, split, 3, False),
        (5, by_default, 3, True),
        (5, dataclasses.replace(by_default, x_as_is=True), 3, False),
        (5, dataclasses.replace(by_default, x_as_is=False), 0, True),
    ):
        launch = gemv.PackedGemv(view, word_view(view), m, torch.float32, False, cfg)
        assert launch.counters == counters and (launch.reduce is not None) == reduce, (m, cfg)


def test_tile_counters_are_kept_per_device_and_stream_except_while_a_graph_captures(
    monkeypatch,
):
    """``split_counters`` keeps one zeroed buffer per device and stream (grown as launches need
    more); while a CUDA graph captures it hands out a fresh buffer that it does not keep."""
    monkeypatch.setattr(splits, "_COUNTERS", {})
    stream = [7]
    monkeypatch.setattr(splits, "current_stream", lambda device: stream[0])
    capturing = [False]
    monkeypatch.setattr(splits, "capturing_cuda_graph", lambda device: capturing[0])
    cpu = torch.device("cpu")
    first = splits.split_counters(cpu, 10)
    assert first.numel() >= 10 and not first.any()
    assert splits.split_counters(cpu, 10) is first
    stream[0] = 8
    other_stream = splits.split_counters(cpu, 10)
    assert other_stream is not first
    larger = splits.split_counters(cpu, first.numel() + 1)
    assert larger.numel() > first.numel() and splits.split_counters(cpu, 2) is larger
    capturing[0] = True
    stream[0] = 9
    captured = splits.split_counters(cpu, 10)
    assert splits.split_counters(cpu, 10) is not captured  # never kept
    capturing[0] = False
    assert splits.split_counters(cpu, 10) is not captured


def _counting(launch, launched: list[str], name: str):
    def counted(*args, **kwargs):
        launched.append(name)
        return launch(*args, **kwargs)

    return counted


def test_rows_are_read_as_they_are_except_first_and_while_a_graph_captures(monkeypatch):
    """The default (``x_as_is=None``): tensor-core rows regrouped in the first call (it
    compiles the launch a CUDA graph would capture) and while the stream captures, read as
    they are otherwise; one row is always read as it is. Every way gives the same output."""
    payload = quantized(40, 256, ("int4", {"group_size": 64}))
    view = kernel_weight(payload)
    regrouped: list[int] = []
    permute = gemv.permute_codes
    monkeypatch.setattr(gemv, "permute_codes", lambda x: regrouped.append(1) or permute(x))
    capturing = [False]
    monkeypatch.setattr(gemv, "capturing_cuda_graph", lambda device: capturing[0])
    cfg = LinearConfig("gemv", 16, 16, 64, split_k=2)
    assert cfg.x_as_is is None
    x = torch.randn(5, 256)
    launch = gemv.PackedGemv(view, word_view(view), 5, torch.float32, False, cfg)
    first = launch(x, None)
    assert regrouped == [1]
    assert rel_err(first, _reference(x, payload)) < TOLERANCE[torch.float32]
    taken = []
    for capture in (False, False, True, False):
        capturing[0] = capture
        regrouped.clear()
        assert torch.equal(launch(x, None), first)
        taken.append(len(regrouped))
    assert taken == [0, 0, 1, 0]
    one_row = gemv.PackedGemv(view, word_view(view), 1, torch.float32, False, cfg)
    regrouped.clear()
    capturing[0] = True
    one_row(x[:1], None)
    assert regrouped == []


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_packed_gemv_half_activations(dtype):
    payload = quantized(32, 128, ("nvfp4", {}))
    for m in (1, 2, 16):  # FMAs on x as it is, tensor-core dots on x regrouped
        x = torch.randn(m, 128).to(dtype)
        out = quantized_linear(x, payload, config=LinearConfig("gemv", 16, 32, 128))
        assert out.dtype == dtype
        assert rel_err(out, _reference(x, payload)) < TOLERANCE[dtype], m


def test_nvfp4_divide_convention_and_odd_int4_width():
    from qlens.quant.codecs.nvfp4 import pack_nvfp4

    base = quantized(24, 96, ("nvfp4", {}))
    divide = pack_nvfp4(
        base.data, base.scales, 2.5 / base.global_scale, (24, 96), global_convention="divide"
    )
    int4 = quantized(24, 95, ("int4", {"group_size": 32}))  # 48 bytes a row: whole words
    for payload, k in ((divide, 96), (int4, 95)):
        assert word_view(kernel_weight(payload)) is not None
        x = torch.randn(3, k)
        out = quantized_linear(x, payload, config=LinearConfig("gemv", 16, 16, 64, split_k=2))
        assert rel_err(out, _reference(x, payload)) < TOLERANCE[torch.float32]


def test_rows_that_are_not_whole_words_take_the_byte_kernel():
    payload = quantized(16, 90, ("int4", {"group_size": 32}))  # 45 bytes a row
    assert word_view(kernel_weight(payload)) is None
    x = torch.randn(2, 90)
    out = quantized_linear(x, payload, config=LinearConfig("gemv", 16, 16, 64))
    assert rel_err(out, _reference(x, payload)) < TOLERANCE[torch.float32]


def _spy(fn, calls, label):
    def wrapped(*args, **kwargs):
        calls.append(label)
        return fn(*args, **kwargs)

    return wrapped


def test_word_kernel_is_the_default_and_can_be_turned_off(monkeypatch):
    import qlens.kernels.gemv as gemv

    payload = quantized(40, 328, FAMILIES[0])
    x = torch.randn(3, 328)
    assert word_view(kernel_weight(payload)) is not None
    assert default_config(payload, 3, x.device).words
    launched = []
    monkeypatch.setattr(gemv, "PackedGemv", _spy(gemv.PackedGemv, launched, "word"))
    monkeypatch.setattr(gemv, "ByteGemv", _spy(gemv.ByteGemv, launched, "byte"))
    word = quantized_linear(x, payload, config=LinearConfig("gemv", 16, 16, 64))
    # the byte-wise kernel, for comparisons
    byte_config = LinearConfig("gemv", 16, 16, 64, words=False)
    assert default_config(payload, 3, x.device, words=False).words is False
    byte = quantized_linear(x, payload, config=byte_config)
    assert launched == ["word", "byte"]
    reference = _reference(x, payload)
    assert rel_err(word, reference) < TOLERANCE[torch.float32]
    assert rel_err(byte, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("scheme", ("int4", "mxfp4", "nvfp4"))
def test_one_row_is_read_as_it_is_and_more_rows_are_regrouped(scheme, monkeypatch):
    """One row meets FMAs as the caller holds it, with no copy before the launch; rows on
    tensor cores are regrouped by code position first, one copy a call."""
    cfg = LinearConfig("gemv", 16, 32, 128)
    payload = quantized(32, 128, (scheme, {}))
    view = kernel_weight(payload)
    regrouped: list[tuple[int, ...]] = []
    permute = gemv.permute_codes

    def recording(x):
        regrouped.append(tuple(x.shape))
        return permute(x)

    monkeypatch.setattr(gemv, "permute_codes", recording)
    for m in (1, 3):
        x = torch.randn(m, 128)
        out = gemv.prepare_gemv(view, m, x.dtype, False, cfg)(x, None)
        assert rel_err(out, _reference(x, payload)) < TOLERANCE[torch.float32], m
    assert regrouped == [(3, 128)]
