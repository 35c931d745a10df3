"""Triton dequantize kernels for bitsandbytes, GGUF and BitNet payloads: bit-identical with the
torch codecs (``qlens.dequantize``) in float32, bfloat16 and float16.

Payloads come from the oracle libraries (bitsandbytes.functional, gguf-py, transformers' BitNet
packer) and from random raw bytes, which reach every code, block scale and padding case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks._samples import (
    gguf_payload,
    random_bitnet,
    random_bnb_4bit,
    random_bnb_int8,
    random_gguf,
    seeded_generator,
)
from qlens.kernels.dequant import dequantize_triton
from qlens.kernels.dequant_bitnet import dequantize_bitnet_triton
from qlens.kernels.dequant_bnb import dequantize_bnb_triton
from qlens.kernels.dequant_gguf import GGUF_KERNEL_FORMATS, dequantize_gguf_triton
from qlens.kernels.dequant_launch import DequantLaunch
from qlens.kernels.runtime import interpreting
from qlens.quant.codecs.bitnet import bitnet_format
from qlens.quant.codecs.bnb import BNB_INT8
from qlens.quant.codecs.gguf import GGML_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0, gguf_format
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GGUF_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
_BITS_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(), reason="needs a CUDA GPU, TRITON_INTERPRET=0"
)


def assert_bit_exact(payload: QuantPayload, kernel, launch: DequantLaunch | None = None) -> None:
    """The kernel's output equals the codec's bit for bit (signed zeros included) per dtype,
    with and without value checks."""
    for dtype in DTYPES:
        want = dequantize(payload, dtype).view(_BITS_OF[dtype])
        for check_values in (True, False):
            got = kernel(payload, dtype, launch=launch, check_values=check_values)
            assert got.dtype == dtype and got.shape == want.shape == torch.Size(payload.shape)
            assert torch.equal(got.view(_BITS_OF[dtype]), want), (dtype, check_values)


# ---- bitsandbytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize(
    ("shape", "blocksize"),
    # 17030 elements: 267 absmax blocks over 2 nested blocks, partial last block; 1155: an odd
    # element count (half a byte of padding); 4096: blocks larger than a GPU program's tile.
    [((130, 131), 64), ((33, 35), 128), ((12, 1000), 4096)],
)
def test_bnb_4bit_from_bitsandbytes_is_bit_exact(quant_type, nested, shape, blocksize):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    from qlens.quant.adopt.bnb import payload_from_bnb_4bit

    weight = torch.randn(shape, generator=seeded_generator(blocksize)) * 0.05
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
    )
    payload = payload_from_bnb_4bit(packed, state)
    assert (payload.scales.dtype == torch.uint8) is nested
    assert_bit_exact(payload, dequantize_bnb_triton)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_bnb_4bit_random_codes_and_maps_are_bit_exact(nested):
    assert_bit_exact(random_bnb_4bit((3, 7, 301), 64, nested), dequantize_bnb_triton)


def test_bnb_int8_from_bitsandbytes_is_bit_exact():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(37, 70, generator=seeded_generator(3))
    q, scb, _ = bnb_functional.int8_vectorwise_quant(weight)
    payload = QuantPayload(BNB_INT8, q, (37, 70), scales=scb, layout={"packing": "bitsandbytes"})
    assert_bit_exact(payload, dequantize_bnb_triton)
    expected = bnb_functional.int8_vectorwise_dequant(q, scb)
    assert torch.equal(dequantize_bnb_triton(payload, torch.float32), expected)


def test_bnb_int8_strided_data_is_bit_exact():
    payload = random_bnb_int8(70, 37)
    payload.data = payload.data.T.contiguous().T  # same values, column-major storage
    payload.shape = tuple(payload.data.shape)
    assert not payload.data.is_contiguous()
    assert_bit_exact(payload, dequantize_bnb_triton)


# ---- GGUF --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_from_gguf_py_is_bit_exact(ggml_type):
    gguf = pytest.importorskip("gguf")
    weight = np.random.default_rng(ggml_type.type_id).standard_normal((2, 5, 96))
    qtype = gguf.GGMLQuantizationType(ggml_type.type_id)
    packed = torch.from_numpy(gguf.quants.quantize(weight.astype(np.float32), qtype))
    payload = gguf_payload(packed, ggml_type, (2, 5, 96))
    assert_bit_exact(payload, dequantize_gguf_triton)
    expected = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), qtype))
    assert torch.equal(dequantize_gguf_triton(payload, torch.float32), expected)


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_random_blocks_are_bit_exact(ggml_type):
    assert_bit_exact(random_gguf(ggml_type, (37, 160)), dequantize_gguf_triton)


def test_gguf_input_permutation_is_applied():
    payload = random_gguf(Q4_1, (9, 96), seed=1)
    perm = torch.randperm(96, generator=seeded_generator(2))
    permuted = gguf_payload(payload.data, Q4_1, (9, 96), input_permutation=perm)
    assert_bit_exact(permuted, dequantize_gguf_triton)
    plain = dequantize_gguf_triton(payload, torch.float32)
    assert torch.equal(dequantize_gguf_triton(permuted, torch.float32)[:, perm], plain)


def test_gguf_kernel_formats_are_registered_codec_formats():
    assert set(GGUF_KERNEL_FORMATS) == {gguf_format(t).name for t in GGUF_TYPES}
    assert set(GGUF_KERNEL_FORMATS) < {gguf_format(t).name for t in GGML_TYPES.values()}


# ---- BitNet ------------------------------------------------------------------------------------


@pytest.mark.parametrize("convention", ["divide", "multiply"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_bitnet_is_bit_exact(convention, scale_dtype):
    # 37 rows: R = 10 packed rows, the last quarter holds 7 rows and 3 padding rows.
    assert_bit_exact(random_bitnet((37, 70), convention, scale_dtype), dequantize_bitnet_triton)


@pytest.mark.parametrize("convention", ["divide", "multiply"])
def test_bitnet_negative_scale_gives_negative_zeros(convention):
    payload = random_bitnet((13, 33), convention, scale=-0.37)
    assert_bit_exact(payload, dequantize_bitnet_triton)
    out = dequantize_bitnet_triton(payload, torch.float32)
    assert (out == 0).any() and (out[out == 0].view(torch.int32) == -(2**31)).all()


def test_bitnet_packed_by_transformers_is_bit_exact():
    from transformers.integrations import bitnet as hf_bitnet

    ternary = torch.randint(-1, 2, (37, 70), generator=seeded_generator(4)).to(torch.int8)
    packed = hf_bitnet.pack_weights(ternary.clone().to(torch.int16))  # pads rows with code 0
    scale = torch.tensor([2.5e-3])
    payload = QuantPayload(bitnet_format("divide"), packed, (37, 70), global_scale=scale)
    assert_bit_exact(payload, dequantize_bitnet_triton)
    assert torch.equal(dequantize_bitnet_triton(payload, torch.float32), ternary / scale)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
def test_bitnet_three_dims_and_tiny_scales_are_bit_exact():
    payload = random_bitnet((9, 3, 5), "divide", seed=5)
    # A subnormal scale: +-1/scale overflow to +-inf, 0/scale stays 0 (never 0 * inf = NaN).
    payload.global_scale = torch.tensor([1e-39])
    assert_bit_exact(payload, dequantize_bitnet_triton)


# (37, 68) under the default launch; (21, 36) under the small ones: 6 packed rows (2 tiles of 4,
# the last half full), 9 words (a full tile and 1, or 2 tiles and 1), the last row quarter ragged.
@pytest.mark.parametrize(
    ("shape", "launch"),
    [((37, 68), None)]
    + [
        (shape, launch)
        for shape in [(21, 36), (10, 4, 3), (5, 8)]
        for launch in [None, DequantLaunch(1, 32, 1), DequantLaunch(4, 16, 2)]
    ],
    ids=str,
)
def test_bitnet_word_kernel_is_bit_exact(shape, launch):
    """16-bit outputs of whole int32 words take the word-wise kernel (ragged words, rows and
    packed rows; a last dimension of odd length); float32 and odd widths the byte-wise one."""
    for convention in ("divide", "multiply"):
        payload = random_bitnet(shape, convention, seed=len(shape))
        payload.global_scale = -payload.global_scale  # signed zeros: 0 / negative = -0
        assert_bit_exact(payload, dequantize_bitnet_triton, launch)


def test_bitnet_word_kernel_writes_nan_for_code_three():
    payload = random_bitnet((8, 12), "divide")
    payload.data[1, 4] = 0b11_10_01_00  # rows 1, 3, 5, 7 of column 4: codes 0, 1, 2, 3
    got = dequantize_bitnet_triton(payload, torch.bfloat16, check_values=False)
    plus = (1 / payload.global_scale.float()).to(torch.bfloat16)
    assert got[1, 4] == -plus and got[3, 4] == 0 and got[5, 4] == plus and got[7, 4].isnan()
    with pytest.raises(ValueError, match="invalid 2-bit code 3"):
        dequantize_bitnet_triton(payload, torch.bfloat16)


def test_bitnet_invalid_code_raises_but_padding_is_ignored():
    payload = random_bitnet((6, 8), "multiply")  # R = 2: rows 6 and 7 are padding
    payload.data[1, 3] |= 0b11 << 6  # quarter 3 of packed row 1 = row 7: padding
    assert_bit_exact(payload, dequantize_bitnet_triton)
    payload.data[0, 2] |= 0b11 << 2  # quarter 1 of packed row 0 = row 2: a weight
    with pytest.raises(ValueError, match="invalid 2-bit code 3"):
        dequantize_bitnet_triton(payload, torch.float32)


# ---- the GPU's tile shapes, run in the interpreter (several programs, ragged edges) -----------


def test_gpu_tiles_are_bit_exact_in_the_interpreter():
    from qlens.kernels import dequant_bitnet, dequant_bnb, dequant_gguf

    nested = random_bnb_4bit((29, 301), 64, nested=True)
    assert_bit_exact(nested, dequantize_bnb_triton, dequant_bnb.GPU_4BIT_LAUNCH)
    assert_bit_exact(random_bnb_int8(37, 300), dequantize_bnb_triton, dequant_bnb.GPU_INT8_LAUNCH)
    assert_bit_exact(random_gguf(Q5_1, (11, 544)), dequantize_gguf_triton, dequant_gguf.GPU_LAUNCH)
    bitnet = random_bitnet((70, 300), "divide")
    assert_bit_exact(bitnet, dequantize_bitnet_triton, dequant_bitnet.GPU_LAUNCH)


# Programs in K-first order over several row and column tiles, with ragged edges both ways.
SMALL_TILES = (DequantLaunch(1, 64, 1), DequantLaunch(4, 64, 1), DequantLaunch(16, 32, 2))


@pytest.mark.parametrize("launch", SMALL_TILES, ids=str)
def test_small_tiles_are_bit_exact_through_dequantize_triton(launch):
    payloads = (
        random_bnb_4bit((13, 160), 64, nested=False),
        random_bnb_int8(21, 90),
        random_gguf(Q4_1, (9, 160)),
        random_gguf(Q8_0, (9, 96)),
        random_bitnet((37, 70), "multiply"),
    )
    for payload in payloads:
        got = dequantize_triton(payload, torch.float32, launch=launch)
        assert torch.equal(got.view(torch.int32), dequantize(payload).view(torch.int32))


def test_gguf_tiles_span_whole_blocks():
    with pytest.raises(ValueError, match="block_k must be at least 32, got 16"):
        dequantize_gguf_triton(random_gguf(Q8_0, (2, 64)), launch=DequantLaunch(4, 16))


# ---- bad input ---------------------------------------------------------------------------------

KERNELS = (
    (dequantize_bnb_triton, lambda: random_bnb_4bit((4, 64), 64, nested=False)),
    (dequantize_bnb_triton, lambda: random_bnb_int8(4, 8)),
    (dequantize_gguf_triton, lambda: random_gguf(Q8_0, (2, 64))),
    (dequantize_bitnet_triton, lambda: random_bitnet((8, 4), "divide")),
)


@pytest.mark.parametrize(("kernel", "make"), KERNELS)
def test_cpu_tensors_need_the_interpreter(kernel, make, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA device .* set TRITON_INTERPRET=1"):
        kernel(make(), torch.float32)


@pytest.mark.parametrize(("kernel", "make"), KERNELS)
def test_rejects_non_float_outputs(kernel, make):
    with pytest.raises(ValueError, match="outputs .* not torch.int8; use qlens.dequantize"):
        kernel(make(), torch.int8)


def test_rejects_payloads_of_other_families():
    bitnet = random_bitnet((8, 4), "divide")
    with pytest.raises(ValueError, match="reads the formats .*'bnb_int8'.*not 'bitnet'"):
        dequantize_bnb_triton(bitnet, torch.float32)
    with pytest.raises(ValueError, match="reads 'bitnet' payloads, not 'bnb_int8'"):
        dequantize_bitnet_triton(random_bnb_int8(4, 8), torch.float32)
    k_quant = gguf_payload(torch.zeros(1, Q4_K.type_size, dtype=torch.uint8), Q4_K, (1, 256))
    with pytest.raises(ValueError, match="not 'gguf_q4_k'; use qlens.dequantize"):
        dequantize_gguf_triton(k_quant, torch.float32)


@pytest.mark.filterwarnings("ignore:.* encountered in divide:RuntimeWarning")
def test_rejects_malformed_payloads_like_the_codecs():
    flat = random_bnb_4bit((8, 64), 64, nested=False)
    flat.data = flat.data[:100]
    with pytest.raises(ValueError, match=r"`data` must have shape \[256, 1\]"):
        dequantize_bnb_triton(flat, torch.float32)
    nested = random_bnb_4bit((8, 64), 64, nested=True)
    del nested.layout["nested_blocksize"]
    with pytest.raises(ValueError, match="needs layout\\['nested_blocksize'\\]"):
        dequantize_bnb_triton(nested, torch.float32)
    nan_scales = random_bnb_int8(4, 8)
    nan_scales.scales[1] = float("nan")
    with pytest.raises(ValueError, match="`scales` must be finite"):
        dequantize_bnb_triton(nan_scales, torch.float32)
    gguf = random_gguf(Q4_0, (2, 64))
    with pytest.raises(ValueError, match="multiples of 32 weights, got 40"):
        dequantize_gguf_triton(gguf_payload(gguf.data, Q4_0, (2, 40)), torch.float32)
    gguf.layout["ggml_type"] = Q4_1.type_id
    with pytest.raises(ValueError, match="layout\\['ggml_type'\\] says 3"):
        dequantize_gguf_triton(gguf, torch.float32)
    repeated = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="not a permutation"):
        dequantize_gguf_triton(
            gguf_payload(gguf.data, Q4_0, (2, 64), input_permutation=repeated), torch.float32
        )
    bitnet = random_bitnet((8, 4), "divide")
    bitnet.global_scale = torch.zeros(1)
    with pytest.raises(ValueError, match=r"weight_scale\) is 0"):
        dequantize_bitnet_triton(bitnet, torch.float32)
    bitnet.global_scale, bitnet.shape = torch.ones(1), (12, 4)
    with pytest.raises(ValueError, match=r"`data` must have shape \[3, 4\]"):
        dequantize_bitnet_triton(bitnet, torch.float32)


@pytest.mark.filterwarnings("ignore:.* encountered in divide:RuntimeWarning")
def test_unchecked_values_flow_into_the_weight_as_nan_or_inf():
    bnb = random_bnb_4bit((2, 128), 64, nested=False)
    bnb.scales[1] = float("nan")  # the second block: elements 64-127
    out = dequantize_bnb_triton(bnb, torch.float32, check_values=False).flatten()
    assert torch.equal(out.isnan(), (torch.arange(256) // 64) == 1)
    bitnet = random_bitnet((8, 4), "divide")
    bitnet.data[0, 0] |= 0b11  # row 0, column 0
    out = dequantize_bitnet_triton(bitnet, torch.float32, check_values=False)
    assert out[0, 0].isnan() and out.isnan().sum() == 1
    zero_scale = random_bitnet((8, 4), "divide")
    ternary = torch.sign(dequantize(zero_scale, torch.float32))
    zero_scale.global_scale = torch.zeros(1)
    out = dequantize_bitnet_triton(zero_scale, torch.float32, check_values=False)
    assert torch.equal(out.isnan(), ternary == 0)
    assert torch.equal(out[ternary != 0], ternary[ternary != 0] * float("inf"))


# ---- compiled for a real GPU -------------------------------------------------------------------


@pytest.mark.gpu
@on_gpu
def test_kernels_are_bit_exact_on_gpu():
    payloads = [
        (random_bnb_4bit((300, 517), 64, nested=False), dequantize_bnb_triton),
        (random_bnb_4bit((300, 517), 64, nested=True), dequantize_bnb_triton),
        (random_bnb_4bit((30, 1000), 4096, nested=True), dequantize_bnb_triton),
        (random_bnb_int8(300, 517), dequantize_bnb_triton),
        *((random_gguf(t, (3, 100, 544)), dequantize_gguf_triton) for t in GGUF_TYPES),
    ]
    for width in (517, 516):  # byte-wise kernel; word-wise for 16-bit outputs
        payloads += [
            (random_bitnet((301, width), "divide"), dequantize_bitnet_triton),
            (random_bitnet((301, width), "multiply", torch.bfloat16), dequantize_bitnet_triton),
            (random_bitnet((301, width), "multiply", scale=-0.37), dequantize_bitnet_triton),
            (random_bitnet((301, width), "divide", scale=-0.37), dequantize_bitnet_triton),
        ]
        tiny_scale = random_bitnet((301, width), "divide")
        tiny_scale.global_scale = torch.tensor([1e-39])
        payloads.append((tiny_scale, dequantize_bitnet_triton))
    payloads.append((random_bitnet((30, 4, 3), "divide"), dequantize_bitnet_triton))
    perm = torch.randperm(544, generator=seeded_generator(0))
    permuted = random_gguf(Q5_1, (100, 544))
    permuted.extras["input_permutation"] = perm
    payloads.append((permuted, dequantize_gguf_triton))
    for payload, kernel in payloads:
        assert_bit_exact(payload.to("cuda"), kernel)


@pytest.mark.parametrize(
    "make",
    [
        lambda: random_bnb_4bit((3, 7, 64), 64, True),
        lambda: random_bnb_int8(9, 40),
        lambda: random_gguf(Q4_1, (5, 64)),
        lambda: random_bitnet((9, 24), "multiply"),
    ],
    ids=["bnb_nf4_nested", "bnb_int8", "gguf_q4_1", "bitnet"],
)
def test_dequantize_triton_routes_library_packings_to_their_kernels(make):
    from qlens.kernels import dequantize_triton

    payload = make()
    for dtype in DTYPES:
        want = dequantize(payload, dtype).view(_BITS_OF[dtype])
        assert torch.equal(dequantize_triton(payload, dtype).view(_BITS_OF[dtype]), want)
