"""torchao's ``NF4Tensor`` (QLoRA): NF4 codes with double-quantized per-block absmax scalers.

Layout (``format.name == "nf4_torchao"``) of a weight of ``numel`` elements, flattened row-major:

- ``data uint8 [numel / 2]``: two codes per byte, the earlier element in the high nibble; each
  code indexes ``extras["nf4"]`` (the 16 NF4 values, in the weight's dtype).
- ``scales int8 [numel / block]``: the absmax scaler of each block of ``block`` elements,
  quantized in groups of ``scaler_block`` scalers: ``scaler = (q / factor).to(dtype) + mean``
  with ``extras["quantization_factor"] [numel / block / scaler_block]`` and the scalar
  ``extras["scaler_mean"]``.

``W = nf4[code] * scaler``, computed in ``layout["dtype"]`` as torchao's
``NF4Tensor.get_original_weight`` does (bit-exact in that dtype), then cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qlens.quant.codecs.checks import require_dtype, require_shape, require_tensor
from qlens.quant.codecs.registry import register_dequantizer
from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def nf4_torchao_format(block: int, scaler_block: int) -> QuantFormat:
    return QuantFormat(
        name="nf4_torchao",
        element="nf4",
        bits=4,
        block=(1, block),
        scale_dtype="int8",
        description=f"NF4 codes, one absmax per {block} elements, int8 absmax double-quantized "
        f"per {scaler_block} (torchao NF4Tensor)",
    )


@register_dequantizer("nf4_torchao")
def dequantize_nf4_torchao(payload: QuantPayload, dtype: torch.dtype) -> Tensor:
    """NF4 values times their dequantized block scalers, in the weight's dtype, then cast."""
    numel, block = payload.numel, payload.format.block[1]
    scaler_block = int(payload.layout["scaler_block_size"])
    weight_dtype = _DTYPES[payload.layout["dtype"]]
    data = require_tensor(payload.data, "data", payload)
    require_dtype(data, "data", (torch.uint8,), payload)
    require_shape(data, "data", [numel // 2], payload)
    quantized = require_tensor(payload.scales, "scales", payload)
    require_dtype(quantized, "scales", (torch.int8,), payload)
    require_shape(quantized, "scales", [numel // block], payload)
    factor = payload.extras["quantization_factor"]
    scalers = (quantized.view(-1, scaler_block) / factor.unsqueeze(-1)).flatten().to(
        weight_dtype
    ) + payload.extras["scaler_mean"]
    table = payload.extras["nf4"]
    repeated = scalers.unsqueeze(-1).expand(scalers.numel(), block // 2).flatten()
    high = table[(data >> 4).long()] * repeated
    low = table[(data & 0xF).long()] * repeated
    return torch.stack([high, low], dim=-1).reshape(payload.shape).to(dtype)
