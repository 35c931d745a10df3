"""Round-to-nearest weight quantizers producing payloads in the qlens layouts.

``quantize_weight(W, scheme)`` is deterministic, accepts ``[N, K]`` or experts ``[E, N, K]``,
ragged K (and N for block FP8), all-zero groups and subnormal values.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.bits import pack_nibbles
from qlens.quant.codecs.elements import (
    E2M1_MAX,
    E4M3_MAX,
    ELEMENT_EMAX,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
)
from qlens.quant.codecs.fp8 import pack_fp8_block
from qlens.quant.codecs.grid import expand_blocks
from qlens.quant.codecs.intgroup import pack_int_group
from qlens.quant.codecs.mx import MX_BLOCK, pack_mx
from qlens.quant.codecs.nvfp4 import NV_BLOCK, pack_nvfp4
from qlens.quant.payload import QuantPayload

SCHEMES: dict[str, str] = {
    "fp8-block": "FP8 e4m3, one fp32 scale (amax/448) per 128x128 block; scale_dtype='e8m0' "
    "rounds the scales up to powers of two",
    "mxfp8": "OCP MXFP8: e4m3, one E8M0 scale per 32 along K (e = floor(log2 amax) - 8)",
    "mxfp4": "OCP MXFP4: e2m1 two per byte, one E8M0 scale per 32 along K "
    "(e = floor(log2 amax) - 2)",
    "nvfp4": "NVFP4: e2m1 two per byte, e4m3 scale per 16 along K, fp32 global amax/(6*448) "
    "(multiply convention)",
    "int4": "INT4 group-wise (default group 128), symmetric (q-8)*s with s = amax/7, or "
    "asymmetric=True: (q-z)*s with s = (max-min)/15",
    "int8": "INT8 group-wise (default group 128), symmetric q*s with s = amax/127, or "
    "asymmetric=True: (q-z)*s with s = (max-min)/255",
}
_E4M3_SMALLEST_NORMAL = 2.0**-6
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known schemes: {sorted(SCHEMES)}")
    w = _checked_weight(weight)
    if scheme != "fp8-block" and block_size is not None:
        raise ValueError(f"block_size applies to 'fp8-block' only, not {scheme!r}; use group_size")
    if scheme in ("int4", "int8"):
        size = 128 if group_size is None else int(group_size)
        if size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size}")
        return _quantize_int(
            w, 4 if scheme == "int4" else 8, size, scale_dtype or "fp32", asymmetric
        )
    if asymmetric:
        raise ValueError(f"asymmetric=True applies to int4/int8 only, not {scheme!r}")
    if scheme == "fp8-block":
        if group_size is not None:
            raise ValueError("fp8-block takes block_size=(rows, cols), not group_size")
        block = (128, 128) if block_size is None else block_size
        block = (block, block) if isinstance(block, int) else block
        if scale_dtype not in (None, "fp32", "e8m0"):
            raise ValueError(f"fp8-block scale_dtype must be 'fp32' or 'e8m0', got {scale_dtype!r}")
        return _quantize_fp8_block(w, (int(block[0]), int(block[1])), scale_dtype or "fp32")
    fixed = MX_BLOCK if scheme.startswith("mx") else NV_BLOCK
    if group_size not in (None, fixed):
        raise ValueError(f"{scheme} uses a fixed group of {fixed}, got group_size={group_size}")
    expected_scale = "e4m3" if scheme == "nvfp4" else "e8m0"
    if scale_dtype not in (None, expected_scale):
        raise ValueError(f"{scheme} scales are {expected_scale}, got scale_dtype={scale_dtype!r}")
    if scheme == "nvfp4":
        return _quantize_nvfp4(w)
    return _quantize_mx(w, "e4m3" if scheme == "mxfp8" else "e2m1")


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


def _group_view(w: Tensor, group: int) -> Tensor:
    """``[*e, N, K]`` -> zero-padded ``[*e, N, ceil(K/group), group]``."""
    padded = torch.nn.functional.pad(w, (0, -w.shape[-1] % group))
    return padded.unflatten(-1, (-1, group))


def _pow2_exponent_floor(x: Tensor) -> Tensor:
    """floor(log2(x)) for positive finite x, exactly (frexp: x = m * 2**e, m in [0.5, 1))."""
    _, exponent = torch.frexp(x)
    return exponent.to(torch.int32) - 1


def _quantize_fp8_block(w: Tensor, block: tuple[int, int], scale_dtype: str) -> QuantPayload:
    *lead, n, k = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [*e, gn, bn, gk, bk]
    amax = tiles.abs().amax(dim=(-3, -1))
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # amax/448 as in transformers and DeepSeek; only where it falls into (or below) the fp32
    # subnormal range is it rounded up, so that a tiny nonzero block never gets a zero scale.
    tiny = scales < torch.finfo(torch.float32).tiny
    scales = torch.where(tiny, _round_scale_up(amax.double() / E4M3_MAX, torch.float32), scales)
    if scale_dtype == "e8m0":
        # Round up to a power of two: 2**ceil(log2 s) never makes |W / s| exceed 448.
        mantissa, exponent = torch.frexp(scales)
        ceil_log2 = exponent.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
        stored: Tensor = encode_e8m0(ceil_log2)
        scales = torch.ldexp(torch.ones_like(scales), stored.to(torch.int32) - 127)
    else:
        stored = scales
    data = encode_e4m3(w / expand_blocks(scales, block, n, k))
    return pack_fp8_block(data, stored, block=block)


def _quantize_mx(w: Tensor, element: str) -> QuantPayload:
    *lead, n, k = w.shape
    groups = _group_view(w, MX_BLOCK)
    amax = groups.abs().amax(dim=-1)
    emax = ELEMENT_EMAX[element]
    exponent = torch.where(
        amax > 0, _pow2_exponent_floor(amax) - emax, torch.full_like(amax, -127, dtype=torch.int32)
    )
    scale_bytes = encode_e8m0(exponent)
    scale = torch.ldexp(torch.ones_like(amax), scale_bytes.to(torch.int32) - 127)
    scaled = groups / scale.unsqueeze(-1)
    if element == "e4m3":
        data = encode_e4m3(scaled.flatten(-2)[..., :k])
    else:
        data = pack_nibbles(encode_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)))
    return pack_mx(data, scale_bytes, (*lead, n, k))


def _quantize_nvfp4(w: Tensor) -> QuantPayload:
    *lead, n, k = w.shape
    amax = w.abs().amax()
    g = amax / (E4M3_MAX * E2M1_MAX) if bool(amax > 0) else torch.ones((), device=w.device)
    groups = _group_view(w, NV_BLOCK)
    block_scale = groups.abs().amax(dim=-1) / E2M1_MAX
    scales = (block_scale / g).clamp(_E4M3_SMALLEST_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / g) / scales.float()
    scaled = (groups * reciprocal.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    data = pack_nibbles(encode_e2m1(scaled.flatten(-2)))
    return pack_nvfp4(data, scales, g.reshape(()).float(), (*lead, n, k))


def _round_scale_up(ideal: Tensor, dtype: torch.dtype) -> Tensor:
    """``ideal`` (float64) in ``dtype``, rounded up so that no value exceeds the code range."""
    stored = ideal.to(dtype)
    too_small = stored.double() < ideal
    bumped = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(too_small, bumped, stored)


def _quantize_int(
    w: Tensor, bits: int, group: int, scale_dtype: str, asymmetric: bool
) -> QuantPayload:
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"integer scale_dtype must be one of {list(_SCALE_DTYPES)}, got {scale_dtype!r}"
        )
    k = w.shape[-1]
    groups = _group_view(w, group)
    levels = (1 << bits) - 1
    if asymmetric:
        low = groups.amin(dim=-1).clamp(max=0)
        span = groups.amax(dim=-1).clamp(min=0).double() - low.double()
        ideal = torch.where(span > 0, span / levels, torch.ones_like(span))
    else:
        amax = groups.abs().amax(dim=-1).double()
        ideal = torch.where(amax > 0, amax / (levels // 2), torch.ones_like(amax))
    stored = _round_scale_up(ideal, _SCALE_DTYPES[scale_dtype])
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(
            f"the weight's group ranges (up to {float(ideal.max()) * levels:.4g}) overflow "
            f"{scale_dtype} scales; use scale_dtype='fp32'"
        )
    scale = stored.float()
    ratio = groups / scale.unsqueeze(-1)
    if asymmetric:
        zeros = torch.round(-low / scale).clamp(0, levels)
        codes = (torch.round(ratio) + zeros.unsqueeze(-1)).clamp(0, levels)
    else:
        zero = 1 << (bits - 1)
        codes = torch.round(ratio).clamp(-zero, zero - 1) + zero
    codes = codes.flatten(-2)[..., :k].to(torch.int64)
    return pack_int_group(
        codes,
        stored,
        zeros.to(torch.int64) if asymmetric else None,
        bits=bits,
        group_size=group,
    )
