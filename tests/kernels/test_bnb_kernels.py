"""bitsandbytes weights in qlens' fused kernels (Triton interpreter): 4-bit NF4/FP4 bytes read in
place as family ``BNB4`` and LLM.int8 rows as family ``INT8``, every launch path against the
codec's weights, and the payloads the kernels refuse routed to the dequantize kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import rel_err

from benchmarks._samples import random_bnb_4bit, random_bnb_int8
from qlens.kernels import LinearConfig
from qlens.kernels.configs import DECODED_ROWS_CONFIG, choose_config
from qlens.kernels.dequant import dequantize_view, has_dequantize_kernel
from qlens.kernels.dispatch import launch_kernel
from qlens.kernels.gemv import word_view
from qlens.kernels.layout_view import BNB4, INT8
from qlens.kernels.plan import LinearPlan
from qlens.kernels.weights import kernel_weight, unsupported_reason
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from qlens.quant.adopt.bnb import payload_from_bnb_4bit  # noqa: E402
from qlens.quant.codecs.bnb import BNB_INT8  # noqa: E402

# Relative error of a float32 product against the float64 one of the same weights: float32
# accumulation over K <= 512 terms of unit-scale products (a few ulps times sqrt(K)).
F32_TOLERANCE = 1e-5
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bnb_payload(quant_type: str, nested: bool, n: int, k: int, blocksize: int) -> QuantPayload:
    """A payload of a random ``[n, k]`` weight quantized by bitsandbytes itself (on the CPU)."""
    gen = torch.Generator().manual_seed(n * k + blocksize)
    weight = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, k)
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
    )
    return payload_from_bnb_4bit(packed, state)


def int8_payload(n: int, k: int) -> QuantPayload:
    """A payload of a random ``[n, k]`` weight (rows of very different scales) quantized by
    bitsandbytes' own ``int8_vectorwise_quant`` (on the CPU)."""
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    q, scb, _ = bnb_functional.int8_vectorwise_quant(weight)
    return QuantPayload(BNB_INT8, q, (n, k), scales=scb, layout={"packing": "bitsandbytes"})


# K a multiple of every tile, K of no power of two, K over several tiles
INT8_SHAPES = [(40, 320), (24, 100), (33, 512)]


CASES = [("nf4", False, 40, 320, 64), ("fp4", True, 24, 256, 128), ("nf4", True, 33, 512, 32)]
# (path, rows, K splits, block_n, block_k): the one-row word GEMV (split, narrow), tensor-core
# rows of the word GEMV, the split-K and GEMM tensor-core kernels, and the dequantize path.
LAUNCHES = [
    ("gemv", 1, 1, 32, 256), ("gemv", 1, 2, 8, 64), ("gemv", 3, 1, 32, 64),
    ("gemv", 17, 2, 32, 128), ("splitk", 20, 2, 32, 64), ("gemm", 70, 1, 32, 64),
    ("dequant", 5, 1, 32, 64),
]  # fmt: skip


def assert_every_launch_path_matches(payload: QuantPayload, seed: int) -> torch.Generator:
    """Every launch of ``LAUNCHES`` on ``payload``'s view against the float64 product of the
    codec's weights; returns the generator, for more draws."""
    view = kernel_weight(payload)
    weight = dequantize(payload, torch.float32).double()
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(view.n, generator=gen)
    for path, rows, split, block_n, block_k in LAUNCHES:
        x = torch.randn(rows, view.k, generator=gen)
        cfg = LinearConfig(path, 16, block_n, block_k, split_k=split)
        out = launch_kernel(x, view, bias, cfg)
        assert rel_err(out, F.linear(x.double(), weight, bias.double())) < F32_TOLERANCE, path
    return gen


def test_flat_payload_is_read_in_place():
    payload = bnb_payload("nf4", False, 40, 320, 64)
    view = kernel_weight(payload)
    assert view.family == BNB4 and view.packed and (view.group_n, view.group_k) == (1, 64)
    assert view.data.shape == (40, 160) and view.scales.shape == (40, 5)
    assert view.data.data_ptr() == payload.data.data_ptr()
    assert view.scales.data_ptr() == payload.scales.data_ptr()
    assert view.code_table is not None and torch.equal(view.code_table, payload.extras["code"])
    assert word_view(view) is not None  # whole 16-byte-aligned words: the word-wise GEMV


def test_nested_absmax_is_decoded_as_the_codec_decodes_it():
    payload = bnb_payload("nf4", True, 33, 512, 32)
    assert payload.scales.dtype == torch.uint8
    view = kernel_weight(payload)
    assert view.scales.dtype == torch.float32 and view.scales.shape == (33, 16)
    codes = torch.stack([view.data >> 4, view.data & 0xF], dim=-1).reshape(33, 512).long()
    weight = view.code_table[codes] * view.scales.repeat_interleave(32, dim=1)
    assert torch.equal(weight, dequantize(payload, torch.float32))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_launch_path_matches_the_codec(case):
    payload = bnb_payload(*case)
    view = kernel_weight(payload)
    weight = dequantize(payload, torch.float32).double()
    gen = assert_every_launch_path_matches(payload, seed=1)
    for rows in (1, 4):  # the byte-wise GEMV
        x = torch.randn(rows, view.k, generator=gen)
        out = launch_kernel(x, view, None, LinearConfig("gemv", 16, 32, 64, words=False))
        assert rel_err(out, F.linear(x.double(), weight)) < F32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_path_is_bit_exact(dtype):
    for case in CASES:
        payload = bnb_payload(*case)
        got = dequantize_view(kernel_weight(payload), dtype)
        assert torch.equal(got.view(_BITS[dtype]), dequantize(payload, dtype).view(_BITS[dtype]))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bf16_rows_through_the_plan_match_the_codec(kind):
    payload = bnb_payload("nf4", False, 40, 320, 64) if kind == "nf4" else int8_payload(40, 320)
    plan = LinearPlan(payload, torch.device("cpu"), route="kernel")
    assert plan.config(1).path == "gemv"  # NF4: the packed GEMV; LLM.int8: the byte-wise one
    weight = dequantize(payload, torch.bfloat16).double()
    for rows in (1, 2, 40):
        x = torch.randn(rows, 320).bfloat16()
        out = plan(x)
        assert out.dtype == torch.bfloat16
        # bf16 output rounding (2**-9 relative) over float32 accumulation
        assert rel_err(out, F.linear(x.double(), weight)) < 4e-3, rows


def test_random_code_maps_and_absmax_reach_every_code():
    # Random 16-entry maps (not NF4's) and random nested absmax: every code at every nibble.
    for nested in (False, True):
        payload = random_bnb_4bit((24, 512), 64, nested)
        view = kernel_weight(payload)
        x = torch.randn(3, 512)
        weight = dequantize(payload, torch.float32).double()
        for cfg in (LinearConfig("gemv", 16, 8, 128), LinearConfig("gemv", 16, 16, 64)):
            out = launch_kernel(x[:1], view, None, cfg)
            assert rel_err(out, F.linear(x[:1].double(), weight)) < F32_TOLERANCE


def test_blocks_straddling_rows_take_the_dequantize_kernel():
    # K = 96 with blocks of 64: blocks cross rows, which the fused kernels' groups cannot.
    payload = bnb_payload("nf4", False, 8, 96, 64)
    reason = unsupported_reason(payload)
    assert reason is not None and "not a multiple of the absmax block (64)" in reason
    assert has_dequantize_kernel(payload)
    with pytest.raises(ValueError, match="blocks straddle rows"):
        kernel_weight(payload)


def test_wrong_code_map_is_refused_by_name():
    payload = bnb_payload("nf4", False, 8, 128, 64)
    payload.extras["code"] = payload.extras["code"][:8]
    with pytest.raises(ValueError, match=r"extras\['code'\] must be the 16-entry float32"):
        kernel_weight(payload)


def test_one_row_takes_the_packed_gemv_and_more_rows_decode_once():
    # launch_tables.BNB4_PACKED_GEMV_MAX_M: table lookups on tensor cores lost to cuBLAS.
    plan = LinearPlan(bnb_payload("nf4", False, 40, 320, 64), torch.device("cpu"), route="kernel")
    assert plan.config(1).path == "gemv"
    assert {plan.config(m).path for m in (2, 8, 32, 300)} == {"dequant"}
    # The rule is choose_config's, whatever the tables: other codes keep their paths.
    cpu = torch.device("cpu")
    assert choose_config(2, 40, 320, cpu, table_codes=True) == DECODED_ROWS_CONFIG
    assert choose_config(2, 40, 320, cpu).path != "dequant"


# ---- LLM.int8 ----------------------------------------------------------------------------------


def test_int8_rows_are_read_in_place_with_one_multiplier_a_row():
    payload = int8_payload(40, 320)
    view = kernel_weight(payload)
    assert view.family == INT8 and not view.packed
    assert (view.group_n, view.group_k) == (1, 512)  # one group spans each row
    assert view.data.data_ptr() == payload.data.data_ptr()
    assert view.scales.shape == (40, 1) and view.scales.dtype == torch.float32
    # SCB / 127 with bitsandbytes' constant; the codec multiplies in the other order, one
    # float32 rounding apart
    weight = view.data.float() * view.scales
    expected = dequantize(payload, torch.float32)
    torch.testing.assert_close(weight, expected, rtol=2**-22, atol=0)


@pytest.mark.parametrize("shape", INT8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_every_launch_path_matches_the_codec(shape):
    assert_every_launch_path_matches(int8_payload(*shape), seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_dequantize_path_is_one_float32_rounding_from_the_codec(dtype):
    for shape in INT8_SHAPES:
        payload = random_bnb_int8(*shape, seed=shape[1])
        got = dequantize_view(kernel_weight(payload), torch.float32)
        torch.testing.assert_close(got, dequantize(payload, torch.float32), rtol=2**-22, atol=0)
        if dtype != torch.float32:  # rounded once more: at most one step of the narrow type
            narrow = dequantize_view(kernel_weight(payload), dtype)
            step = torch.finfo(dtype).eps
            torch.testing.assert_close(narrow, dequantize(payload, dtype), rtol=step, atol=0)


def test_int8_malformed_payloads_are_refused_by_name():
    payload = int8_payload(8, 64)
    payload.scales = payload.scales.double()
    with pytest.raises(ValueError, match="scales must be the 8 float32 row absmax"):
        kernel_weight(payload)
    strided = random_bnb_int8(64, 8)
    strided.data = strided.data.T.contiguous().T  # column-major storage
    reason = unsupported_reason(strided)
    assert reason is not None and "data must be row-major (contiguous)" in reason
    assert has_dequantize_kernel(strided)  # bitsandbytes' dequantize kernel reads any strides
