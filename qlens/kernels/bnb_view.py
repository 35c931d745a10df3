"""The launch views of bitsandbytes payloads (NF4/FP4 and LLM.int8): their own bytes, in place.

bitsandbytes keeps the flattened weight two codes a byte, high nibble first, and one absmax
per ``blocksize`` flattened elements. When every row holds whole blocks (``in_features`` a
multiple of the block size, as in every transformers checkpoint), the bytes are rows of
``in_features / 2`` and the absmax groups of ``blocksize`` along K, so the fused kernels read
them as family ``BNB4``: code ``c`` of element ``k`` decodes to ``table[c] * absmax[k //
blocksize]`` in float32, as bitsandbytes computes. A nested (double-quantized) absmax is decoded
once, into float32 (four bytes a block), when the view is built.

LLM.int8 weights (``Linear8bitLt``) are int8 rows with one absmax ``SCB`` a row: family ``INT8``
with one scale group spanning each row, the multiplier ``SCB / 127`` computed once in float32
(bitsandbytes multiplies by its float32 constant for 1/127 after ``SCB``: the two orders can
differ in the last bit of a float32 weight, far below the rounding of a bf16 product).
"""

from __future__ import annotations

import torch

from qlens.kernels.configs import next_pow2
from qlens.kernels.layout_view import BNB4, INT8, KernelWeight
from qlens.quant.codecs.bnb import INT8_RECIPROCAL, PACKING, block_absmax
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.payload import QuantPayload


def _expect(cond: bool, payload: QuantPayload, what: str) -> None:
    if not cond:
        raise ValueError(f"qlens kernels cannot read this {payload.format.name} payload: {what}")


def _linear_shape(payload: QuantPayload) -> tuple[int, int]:
    """``[out, in]`` of a bitsandbytes-packed 2-D payload (raises for another packing or rank)."""
    packing = payload.layout.get("packing")
    _expect(packing == PACKING, payload, f"layout packing is {packing!r}, not {PACKING!r}")
    _expect(
        len(payload.shape) == 2,
        payload,
        f"logical shape {list(payload.shape)} is not a 2-D [out, in] linear weight",
    )
    n, k = (int(s) for s in payload.shape)
    return n, k


def bnb_4bit_view(payload: QuantPayload) -> KernelWeight:
    """Check a ``bnb_nf4``/``bnb_fp4`` payload and return its launch view (no copy of the codes;
    a nested absmax decoded to float32); raises a ValueError naming what does not match."""
    n, k = _linear_shape(payload)
    blocksize = int(payload.format.block[1])
    _expect(
        k % blocksize == 0,
        payload,
        f"in_features {k} is not a multiple of the absmax block ({blocksize}), so blocks straddle "
        "rows; qlens dequantizes it (Triton) and multiplies with cuBLAS instead",
    )
    data = payload.data
    _expect(data.dtype == torch.uint8, payload, f"data must be uint8, got {data.dtype}")
    _expect(
        tuple(data.shape) == (n * k // 2, 1) and data.is_contiguous(),
        payload,
        f"data must be contiguous uint8 [{n * k // 2}, 1] (two codes a byte), got "
        f"{list(data.shape)}",
    )
    code = payload.extras.get("code")
    _expect(
        isinstance(code, torch.Tensor) and code.dtype == torch.float32 and code.numel() == 16,
        payload,
        "extras['code'] must be the 16-entry float32 quant map",
    )
    assert isinstance(code, torch.Tensor)
    absmax = block_absmax(payload, ceil_div(n * k, blocksize))
    return KernelWeight(
        family=BNB4,
        n=n,
        k=k,
        data=data.view(n, k // 2),
        scales=absmax.reshape(n, k // blocksize),
        zeros=None,
        global_scale=None,
        group_n=1,
        group_k=blocksize,
        scale_e8m0=False,
        global_divide=False,
        name=payload.format.name,
        code_table=code.reshape(16).contiguous(),
    )


def bnb_int8_view(payload: QuantPayload) -> KernelWeight:
    """Check a ``bnb_int8`` payload and return its launch view: the int8 rows in place, one
    float32 multiplier ``SCB / 127`` a row; raises a ValueError naming what does not match."""
    n, k = _linear_shape(payload)
    data, scb = payload.data, payload.scales
    _expect(
        data.dtype == torch.int8 and tuple(data.shape) == (n, k),
        payload,
        f"data must be int8 [{n}, {k}], got {data.dtype} {list(data.shape)}",
    )
    _expect(
        data.is_contiguous(),
        payload,
        "data must be row-major (contiguous); qlens dequantizes other strides (Triton) and "
        "multiplies with cuBLAS instead",
    )
    _expect(
        isinstance(scb, torch.Tensor) and scb.dtype == torch.float32 and scb.numel() == n,
        payload,
        f"scales must be the {n} float32 row absmax values (SCB)",
    )
    assert scb is not None
    # One group spans each row: a power of two (the kernels' tile arithmetic) of at least K.
    row_group = max(16, next_pow2(k))
    return KernelWeight(
        family=INT8,
        n=n,
        k=k,
        data=data,
        scales=(scb.reshape(n, 1) * INT8_RECIPROCAL).contiguous(),
        zeros=None,
        global_scale=None,
        group_n=1,
        group_k=row_group,
        scale_e8m0=False,
        global_divide=False,
        name=payload.format.name,
    )
