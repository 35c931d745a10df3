"""The torch reference every kernel is checked against: dequantize, then an ordinary matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Float8e4m3fn
from torch import Tensor

from qlens.quant.codecs.elements import E4M3_MAX, encode_e4m3
from qlens.quant.codecs.grid import expand_groups
from qlens.quant.payload import QuantPayload


def reference_linear(
    x: Float[Tensor, "*batch k"],
    payload: QuantPayload,
    bias: Float[Tensor, " n"] | None = None,
) -> Float[Tensor, "*batch n"]:
    """``x @ W.T + bias`` with ``W = dequantize(payload)``, on any device, in ``x``'s dtype.

    The product is computed in float32 (float64 for float64 inputs) and cast back, so it is at
    least as accurate as the Triton kernels it serves as reference for.
    """
    from qlens.quant.dequantize import dequantize

    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight = dequantize(payload, torch.float32).to(compute)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"input's last dim {x.shape[-1]} does not match the weight's in_features "
            f"(weight shape {list(weight.shape)}); reference_linear takes a 2-D [out, in] payload"
        )
    b = None if bias is None else bias.to(compute)
    return F.linear(x.to(compute), weight.to(x.device), b).to(x.dtype)


def reference_act_quant(
    x: Float[Tensor, "m k"], group: int = 128
) -> tuple[Float8e4m3fn[Tensor, "m k"], Float[Tensor, "m groups"]]:
    """Per-token dynamic FP8 of activations: one scale ``amax / 448`` per ``group`` along K.

    All-zero groups get scale 1. Returns e4m3 codes ``[m, k]`` and float32 scales.
    """
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1)
    # A tensor divisor: CUDA torch divides by a Python scalar through its reciprocal, which can
    # differ from the kernels' correctly rounded ``amax / 448`` in the last bit and then flip
    # codes that sit on a rounding tie.
    scales = amax / torch.full_like(amax, E4M3_MAX)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = encode_e4m3(padded / scales[..., None]).view(m, groups * group)[:, :k]
    return codes.contiguous(), scales


def fp8_rounded_activations(x: Float[Tensor, "*batch k"], group: int) -> Float[Tensor, "*batch k"]:
    """``x`` as W8A8 reads it: ``reference_act_quant`` per token and ``group`` along K, decoded
    again (``code * scale``) in float32 (float64 for float64 ``x``)."""
    k = x.shape[-1]
    codes, scales = reference_act_quant(x.reshape(-1, k), group)
    decoded = codes.float() * expand_groups(scales, group, k)
    return decoded.to(torch.float64 if x.dtype == torch.float64 else torch.float32).reshape(x.shape)


def reference_w8a8_linear(
    x: Float[Tensor, "*batch k"],
    payload: QuantPayload,
    bias: Float[Tensor, " n"] | None = None,
) -> Float[Tensor, "*batch n"]:
    """``reference_linear`` on activations that went through ``reference_act_quant`` first,
    with the weight's K block as the activation group."""
    rounded = fp8_rounded_activations(x, payload.format.block[1])
    return reference_linear(rounded, payload, bias).to(x.dtype)
