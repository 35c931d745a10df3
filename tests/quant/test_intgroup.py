"""GPTQ / AWQ / compressed-tensors / qlens integer layouts against words built from their specs."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.quant.codecs.intgroup import pack_int_group, repack_to_qlens
from qlens.quant.codecs.intpackings import pack_awq, pack_compressed_tensors, pack_gptq
from qlens.quant.dequantize import dequantize
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _words_32_over_b(values: list[int], bits: int) -> list[int]:
    """GPTQ 2/4/8-bit words: value j of a word at bits [b*j, b*j + b), 32/b per word."""
    per = 32 // bits
    words = []
    for start in range(0, len(values), per):
        word = 0
        for j, v in enumerate(values[start : start + per]):
            word |= v << (bits * j)
        words.append(_int32(word))
    return words


def _gptq_3bit_words(values: list[int]) -> list[int]:
    """GPTQ 3-bit: each run of 32 values fills 3 words, written out as the format documents it."""
    words = []
    for start in range(0, len(values), 32):
        v = values[start : start + 32]
        w0 = sum(v[j] << (3 * j) for j in range(10)) | ((v[10] & 0b11) << 30)
        w1 = (v[10] >> 2) | sum(v[11 + j] << (3 * j + 1) for j in range(10)) | ((v[21] & 1) << 31)
        w2 = (v[21] >> 1) | sum(v[22 + j] << (3 * j + 2) for j in range(10))
        words += [_int32(w0), _int32(w1), _int32(w2)]
    return words


def _gptq_payload(bits, group, n, k, codes, zeros_stored, scales, fmt="gptq", g_idx=None):
    words = _gptq_3bit_words if bits == 3 else (lambda vals: _words_32_over_b(vals, bits))
    qweight = torch.tensor([words([codes[kk][nn] for kk in range(k)]) for nn in range(n)]).T
    qzeros = torch.tensor(
        [
            _words_32_over_b(row, bits) if bits != 3 else _gptq_3bit_words(row)
            for row in zeros_stored
        ]
    )
    extras = {} if g_idx is None else {"g_idx": torch.tensor(g_idx, dtype=torch.int32)}
    return QuantPayload(
        format=int_group_format(bits, group, zero_point="int", scale_dtype="fp16"),
        data=qweight.to(torch.int32).contiguous(),
        shape=(n, k),
        scales=scales,
        zeros=qzeros.to(torch.int32),
        layout={"packing": "gptq", "checkpoint_format": fmt},
        extras=extras,
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@given(seed=st.integers(0, 2**31 - 1), act_order=st.booleans())
def test_gptq_words_from_the_spec(bits, fmt, seed, act_order):
    gen = torch.Generator().manual_seed(seed)
    per_word = 32 // bits if bits != 3 else 32
    n = per_word if bits != 3 else 32  # qzeros pack along N: whole words
    k, group = 64, 16
    groups = k // group
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen).tolist()
    zeros = torch.randint(1, 1 << bits, (groups, n), generator=gen)
    stored = (zeros - 1) if fmt == "gptq" else zeros
    scales = (torch.rand(groups, n, generator=gen) + 0.5).half()
    g_idx = (
        torch.randperm(k, generator=gen).div(group, rounding_mode="floor").tolist()
        if act_order
        else None
    )
    payload = _gptq_payload(bits, group, n, k, codes, stored.tolist(), scales, fmt, g_idx)
    g = torch.tensor(g_idx) if act_order else torch.arange(k) // group
    expected = (scales.float()[g] * (torch.tensor(codes) - zeros[g]).float()).T
    assert torch.equal(dequantize(payload), expected)
    assert torch.equal(dequantize(payload, torch.float16), expected.half())
    # the packer writes the same words
    qweight, qzeros, packed_scales = pack_gptq(
        torch.tensor(codes).T, scales.T, zeros.T, bits=bits, group_size=group, checkpoint_format=fmt
    )
    assert torch.equal(qweight, payload.data) and torch.equal(qzeros, payload.zeros)
    assert torch.equal(packed_scales, scales)


def test_gptq_v1_reads_stored_plus_one_without_wrapping():
    codes = [[0] * 8 for _ in range(8)]
    payload = _gptq_payload(4, 8, 8, 8, codes, [[15] * 8], torch.ones(1, 8).half())
    assert torch.equal(dequantize(payload), torch.full((8, 8), -16.0))
    with pytest.raises(
        ValueError, match="cannot represent a zero point of 0; use checkpoint_format='gptq_v2'"
    ):
        pack_gptq(
            torch.zeros(8, 8, dtype=torch.long),
            torch.ones(8, 1),
            torch.zeros(8, 1, dtype=torch.long),
            bits=4,
            group_size=8,
        )


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@given(seed=st.integers(0, 2**31 - 1))
def test_awq_words_from_the_spec(seed):
    gen = torch.Generator().manual_seed(seed)
    k, n, group = 32, 16, 16
    q = torch.randint(0, 16, (k, n), generator=gen)  # AWQ's [in, out] view
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    s = (torch.rand(k // group, n, generator=gen) + 0.25).half()

    def words(row):  # nibble i of word j holds column 8j + AWQ_ORDER[i]
        return [
            _int32(sum(int(row[8 * j + AWQ_ORDER[i]]) << (4 * i) for i in range(8)))
            for j in range(len(row) // 8)
        ]

    payload = QuantPayload(
        format=int_group_format(4, group, zero_point="int", scale_dtype="fp16"),
        data=torch.tensor([words(r) for r in q.tolist()], dtype=torch.int32),
        shape=(n, k),
        scales=s,
        zeros=torch.tensor([words(r) for r in z.tolist()], dtype=torch.int32),
        layout={"packing": "awq"},
    )
    expected = (
        (q - z.repeat_interleave(group, 0)).float() * s.float().repeat_interleave(group, 0)
    ).T
    assert torch.equal(dequantize(payload), expected)
    qweight, qzeros, scales = pack_awq(q.T, s.T, z.T)
    assert torch.equal(qweight, payload.data) and torch.equal(qzeros, payload.zeros)


@given(seed=st.integers(0, 2**31 - 1), asym=st.booleans(), bits=st.sampled_from([4, 8]))
def test_repack_to_qlens_is_exact_for_every_packing(seed, asym, bits):
    gen = torch.Generator().manual_seed(seed)
    n, k, group = 16, 48, 16
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zeros = torch.randint(1, 1 << bits, (n, k // group), generator=gen) if asym else None
    scales = (torch.rand(n, k // group, generator=gen) + 0.1).to(torch.bfloat16)
    fmt = int_group_format(bits, group, zero_point="int" if asym else "none", scale_dtype="bf16")
    qweight, qzeros, gscales = pack_gptq(
        codes, scales, zeros, bits=bits, group_size=group, checkpoint_format="gptq_v2"
    )
    gptq = QuantPayload(
        format=fmt,
        data=qweight,
        shape=(n, k),
        scales=gscales,
        zeros=qzeros,
        layout={"packing": "gptq", "checkpoint_format": "gptq_v2"},
    )
    packed, zero_points = pack_compressed_tensors(codes, zeros, bits=bits)
    ct = QuantPayload(
        format=fmt,
        data=packed,
        shape=(n, k),
        scales=scales,
        zeros=zero_points,
        layout={"packing": "compressed-tensors"},
    )
    payloads = [gptq, ct]
    if bits == 4:
        aq, az, ascales = pack_awq(codes, scales, zeros)
        payloads.append(
            QuantPayload(
                format=fmt,
                data=aq,
                shape=(n, k),
                scales=ascales,
                zeros=az,
                layout={"packing": "awq"},
            )
        )
    midpoint = 1 << (bits - 1)
    reference = (
        codes - (zeros if asym else midpoint).repeat_interleave(group, -1)
        if asym
        else codes - midpoint
    ).float() * scales.float().repeat_interleave(group, -1)
    for payload in payloads:
        assert torch.equal(dequantize(payload), reference), payload.layout
        qlens = repack_to_qlens(payload)
        assert qlens.layout["packing"] == "qlens" and qlens.format.name == f"int{bits}"
        assert (qlens.zeros is None) == (not asym)
        assert torch.equal(dequantize(qlens), reference)
        assert torch.equal(qlens.scales, scales)
        expected_dtype = torch.uint8 if bits == 4 else torch.int8
        assert qlens.data.dtype == expected_dtype


def test_repack_refuses_act_order():
    codes = torch.randint(0, 16, (8, 32))
    qweight, qzeros, scales = pack_gptq(codes, torch.ones(8, 2), None, bits=4, group_size=16)
    payload = QuantPayload(
        format=int_group_format(4, 16, zero_point="int"),
        data=qweight, shape=(8, 32), scales=scales, zeros=qzeros,
        layout={"packing": "gptq"},
        extras={"g_idx": torch.arange(32, dtype=torch.int32).flip(0) // 16},
    )  # fmt: skip
    dequantize(payload)  # act-order payloads still dequantize
    with pytest.raises(ValueError, match="act-order .* dequantize it instead"):
        repack_to_qlens(payload)


def test_qlens_int4_layout_bits():
    codes = torch.tensor([[1, 2, 3, 15, 0]])
    payload = pack_int_group(codes, torch.tensor([[2.0]]), bits=4, group_size=8)
    assert payload.data.tolist() == [[0x21, 0xF3, 0x00]]
    assert dequantize(payload).tolist() == [[-14.0, -12.0, -10.0, 14.0, -16.0]]
    asym = pack_int_group(codes, torch.tensor([[0.5]]), torch.tensor([[3]]), bits=4, group_size=8)
    assert asym.zeros.dtype == torch.uint8 and dequantize(asym).tolist() == [
        [-1.0, -0.5, 0.0, 6.0, -1.5]
    ]
    int8 = pack_int_group(
        torch.tensor([[0, 128, 255]]), torch.tensor([[1.0]]), bits=8, group_size=4
    )
    assert int8.data.tolist() == [[-128, 0, 127]] and dequantize(int8).tolist() == [
        [-128.0, 0.0, 127.0]
    ]


def test_quantized_payloads_repack_to_themselves():
    w = torch.randn(4, 40)
    for options in ({}, {"asymmetric": True}):
        p = quantize_weight(w, "int4", group_size=8, **options)
        again = repack_to_qlens(p)
        assert torch.equal(again.data, p.data) and torch.equal(dequantize(again), dequantize(p))
