"""Bit packing: identities on the packed domain, hand-built words, compressed-tensors' packer."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlens.quant.codecs.bits import (
    pack_int32,
    pack_nibbles,
    unpack_int32,
    unpack_nibbles,
    words_for,
)

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


@given(st.integers(1, 5), st.integers(1, 41), st.randoms(use_true_random=False))
def test_nibbles_round_trip(rows, k, rnd):
    codes = torch.tensor(
        [[rnd.randrange(16) for _ in range(k)] for _ in range(rows)], dtype=torch.uint8
    )
    packed = pack_nibbles(codes)
    assert packed.shape == (rows, (k + 1) // 2)
    assert torch.equal(unpack_nibbles(packed, k), codes)
    if k % 2:
        assert torch.all(packed[:, -1] >> 4 == 0)  # padding code is zero


def test_nibbles_low_nibble_holds_the_even_element():
    assert pack_nibbles(torch.tensor([[0x3, 0xA, 0xF]], dtype=torch.uint8)).tolist() == [
        [0xA3, 0x0F]
    ]


@given(
    st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]), st.integers(1, 70), st.randoms(use_true_random=False)
)
def test_int32_round_trip(bits, length, rnd):
    values = torch.tensor([[rnd.randrange(1 << bits) for _ in range(length)] for _ in range(2)])
    words = pack_int32(values, bits)
    assert words.dtype == torch.int32 and words.shape == (2, words_for(length, bits))
    assert torch.equal(unpack_int32(words, bits, length), values)


@given(
    st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]), st.integers(1, 70), st.randoms(use_true_random=False)
)
def test_int32_packing_matches_compressed_tensors(bits, length, rnd):
    offset = 1 << (bits - 1)
    signed = torch.tensor(
        [[rnd.randrange(1 << bits) - offset for _ in range(length)] for _ in range(3)],
        dtype=torch.int8,
    )
    theirs = ct_helpers.pack_to_int32(signed, bits)
    assert torch.equal(pack_int32(signed.long() + offset, bits), theirs)
    assert torch.equal(unpack_int32(theirs, bits, length) - offset, signed.long())


def test_int32_words_built_with_explicit_shifts():
    nibbles = list(range(1, 9))  # 0x87654321: value j at bits 4j..4j+3
    assert pack_int32(torch.tensor([nibbles]), 4).tolist() == [[0x87654321 - (1 << 32)]]
    # 3-bit fields straddle words: field 10 puts its low two bits at bits 30-31 of word 0 and
    # its high bit at bit 0 of word 1; field 21 puts bit 0 at bit 31 of word 1, bits 1-2 at 0-1.
    fields = [0] * 32
    fields[10], fields[21], fields[22] = 0b111, 0b101, 0b001
    words = pack_int32(torch.tensor([fields]), 3)[0].tolist()
    expected = [3 << 30, 1 | (1 << 31), 0b10 | (1 << 2)]
    assert [w & 0xFFFFFFFF for w in words] == expected


def test_int32_packing_rejects_values_that_do_not_fit():
    with pytest.raises(ValueError, match=r"values to pack must lie in \[0, 16\).*range \[-1, 3\]"):
        pack_int32(torch.tensor([[-1, 3]]), 4)
    with pytest.raises(ValueError, match="fewer than 9 4-bit fields; expected at least 2 words"):
        unpack_int32(torch.zeros(1, 1, dtype=torch.int32), 4, 9)
