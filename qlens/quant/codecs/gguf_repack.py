"""Exact repacking of GGUF Q4_0 / Q8_0 blocks into the qlens int4 / int8 layouts.

Q4_0 is ``W = d * (q - 8)`` over 32-blocks with a float16 ``d``: the qlens symmetric int4 layout
with group size 32 and float16 scales. Q8_0 is ``W = d * q`` with int8 ``q``: symmetric int8, same
groups. The other GGML types do not map exactly (Q4_1/Q5_1 add a float minimum, Q5_x have
5-bit codes, K-quants nest scales in super-blocks), so they stay GGUF payloads.
"""

from __future__ import annotations

import torch

from qlens.quant.codecs.gguf import (
    Q4_0,
    Q8_0,
    block_f16,
    gguf_input_permutation,
    low_high_nibbles,
    validate_gguf_payload,
)
from qlens.quant.payload import QuantPayload

GROUP = 32


def gguf_to_int_group(payload: QuantPayload) -> QuantPayload:
    """The weight of a GGUF Q4_0 or Q8_0 payload as a qlens int4 / int8 payload, exactly."""
    from qlens.quant.codecs.intgroup import pack_int_group

    ggml_type = validate_gguf_payload(payload)
    if ggml_type not in (Q4_0, Q8_0):
        raise ValueError(
            f"only GGUF Q4_0 and Q8_0 map exactly onto the qlens int layouts, not "
            f"{ggml_type.name} (a float minimum, 5-bit codes or nested scales); dequantize it "
            "instead (qlens.dequantize)"
        )
    perm = gguf_input_permutation(payload, check_values=False)
    k = int(payload.shape[-1])
    if perm is not None and not torch.equal(perm, torch.arange(k, device=perm.device)):
        raise ValueError(
            "this GGUF payload permutes its input columns (extras['input_permutation']), so its "
            "32-blocks are not contiguous groups of the logical weight; dequantize it instead"
        )
    lead = tuple(int(s) for s in payload.shape[:-1])
    blocks = payload.data.reshape(-1, ggml_type.type_size)
    scales = block_f16(blocks, 0).reshape(*lead, k // GROUP)
    if ggml_type is Q4_0:
        codes = low_high_nibbles(blocks[:, 2:], 16)
        bits = 4
    else:
        codes = blocks[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128
        bits = 8
    return pack_int_group(codes.reshape(*lead, k), scales, None, bits=bits, group_size=GROUP)
