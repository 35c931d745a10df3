"""The kernels' bit-level element decoders against torch's own float8 conversions, every byte."""

from __future__ import annotations

from typing import no_type_check

import torch
import triton
import triton.language as tl

from qlens.kernels.decode import e4m3_to_f32, e8m0_to_f32


@triton.jit
@no_type_check
def _decode_bytes(in_ptr, out_ptr, E8M0: tl.constexpr):
    offs = tl.arange(0, 256)
    b = tl.load(in_ptr + offs)
    if E8M0:
        v = e8m0_to_f32(b)
    else:
        v = e4m3_to_f32(b)
    tl.store(out_ptr + offs, v)


def _decoded(e8m0: bool) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode_bytes[(1,)](codes, out, E8M0=e8m0)
    return out


def test_e4m3_decoder_matches_torch_for_every_byte():
    expected = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    expected = expected.to(torch.float32)
    out = _decoded(False)
    nan = torch.isnan(expected)
    assert nan.sum() == 2  # 0x7F and 0xFF
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], expected[~nan])
    assert torch.equal(torch.signbit(out[~nan]), torch.signbit(expected[~nan]))  # -0.0 kept


def test_e8m0_decoder_matches_torch_for_every_byte():
    expected = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    expected = expected.to(torch.float32)
    out = _decoded(True)
    assert torch.isnan(out[255]) and torch.isnan(expected[255])
    assert torch.equal(out[:255], expected[:255])
