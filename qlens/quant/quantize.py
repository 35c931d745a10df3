"""Round-to-nearest weight quantizers producing payloads in the qlens layouts.

``quantize_weight(W, scheme)`` is deterministic, accepts ``[N, K]`` or experts ``[E, N, K]``,
ragged K (and N for block FP8), all-zero groups and subnormal values. Each scheme is the
``quantize`` of a registered format's codec (``qlens.quant.codecs.registry``); ``SCHEMES``
maps every scheme name to what it does.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.codec import Codec, QuantizeOptions
from qlens.quant.codecs.registry import codecs
from qlens.quant.payload import QuantPayload

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def quantizing_codecs() -> dict[str, Codec]:
    """The codec of every quantize scheme, by scheme name, in registration order."""
    return {codec.scheme: codec for codec in codecs() if codec.quantize is not None}


def __getattr__(name: str) -> dict[str, str]:
    if name == "SCHEMES":  # read from the registered codecs on every access
        return {scheme: c.scheme_description for scheme, c in quantizing_codecs().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quantize_weight(
    weight: Float[Tensor, "*e n k"],
    scheme: str,
    *,
    group_size: int | None = None,
    block_size: int | tuple[int, int] | None = None,
    scale_dtype: str | None = None,
    asymmetric: bool = False,
) -> QuantPayload:
    """Round-to-nearest quantization of a ``[N, K]`` or ``[E, N, K]`` weight (see ``SCHEMES``).

    ``group_size`` applies to int4/int8 (default 128; MX and NVFP4 fix it at 32 and 16);
    ``block_size`` to fp8-block (default ``(128, 128)``); ``scale_dtype`` is "fp32" or "e8m0"
    for fp8-block and "fp32", "bf16" or "fp16" for integers (rounded up so no value clips).
    """
    schemes = quantizing_codecs()
    if scheme not in schemes:
        raise ValueError(f"unknown scheme {scheme!r}; known schemes: {sorted(schemes)}")
    codec = schemes[scheme]
    w = _checked_weight(weight)
    if block_size is not None and "block_size" not in codec.quantize_options:
        takes = [s for s, c in schemes.items() if "block_size" in c.quantize_options]
        raise ValueError(
            f"block_size applies to {', '.join(map(repr, takes))} only, not {scheme!r}; "
            "use group_size"
        )
    if asymmetric and "asymmetric" not in codec.quantize_options:
        takes = [s for s, c in schemes.items() if "asymmetric" in c.quantize_options]
        raise ValueError(f"asymmetric=True applies to {'/'.join(takes)} only, not {scheme!r}")
    options = QuantizeOptions(scheme, group_size, block_size, scale_dtype, asymmetric)
    assert codec.quantize is not None  # quantizing_codecs holds only codecs that quantize
    return codec.quantize(w, options)


def _checked_weight(weight: Tensor) -> Tensor:
    if not isinstance(weight, Tensor) or weight.dtype not in _FLOAT_DTYPES:
        kind = weight.dtype if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(
            f"quantize_weight needs a float16/bfloat16/float32/float64 tensor, got {kind}; "
            "dequantize an already-quantized weight first"
        )
    if weight.dim() < 2:
        raise ValueError(
            f"quantize_weight needs a [out, in] or [experts, out, in] weight, got shape "
            f"{list(weight.shape)}"
        )
    # Contiguous so that every packed tensor derived from it is contiguous too (kernels need it).
    w = weight.detach().float().contiguous()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weight got NaN or infinite weights; fix the weight first")
    return w
