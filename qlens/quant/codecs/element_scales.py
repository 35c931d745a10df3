"""The effective multiplier of every weight element, for error bounds and drift analysis."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.registry import codec_for, codecs
from qlens.quant.payload import QuantPayload


def element_scales(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """Scale applied to each element (``W = element_value * scale``), ``[*e, N, K]`` float32.

    For integer formats this is the group scale (one code step). Read from the format's codec
    (``Codec.element_scales``); the formats qlens quantizes to all have one.
    """
    name = payload.format.name
    scales = codec_for(name).element_scales
    if scales is None:
        known = sorted(c.name for c in codecs() if c.element_scales is not None)
        raise ValueError(f"element_scales does not know format {name!r}; it knows {known}")
    return scales(payload)
