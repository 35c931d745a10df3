"""The effective multiplier of every weight element, for error bounds and drift analysis."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from qlens.quant.codecs.checks import require_tensor
from qlens.quant.codecs.fp8 import fp8_block_scale_grid
from qlens.quant.codecs.grid import expand_blocks, expand_groups
from qlens.quant.codecs.intgroup import unpack_int
from qlens.quant.codecs.mx import MX_BLOCK, mx_scales
from qlens.quant.codecs.nvfp4 import NV_BLOCK, nvfp4_scales
from qlens.quant.payload import QuantPayload


def element_scales(payload: QuantPayload) -> Float[Tensor, "*e n k"]:
    """Scale applied to each element (``W = element_value * scale``), ``[*e, N, K]`` float32.

    For integer formats this is the group scale (one code step). Covers fp8_block, mxfp8, mxfp4,
    nvfp4 and the integer formats.
    """
    *_, n, k = payload.shape
    name = payload.format.name
    if name == "fp8_block":
        return expand_blocks(fp8_block_scale_grid(payload), payload.format.block, n, k)
    if name in ("mxfp8", "mxfp4"):
        return expand_groups(mx_scales(payload), MX_BLOCK, k)
    if name == "nvfp4":
        return expand_groups(nvfp4_scales(payload), NV_BLOCK, k)
    if name.startswith("int") and payload.format.zero_point == "float":
        # a float shift or zero point (optimum-quanto, torchao int4): contiguous groups, one
        # scale each (no integer codes' zero point to decode)
        return expand_groups(require_tensor(payload.scales, "scales", payload).float(),
                             payload.format.block[1], k)  # fmt: skip
    if name.startswith("int"):
        groups = unpack_int(payload)
        return groups.scales.float().index_select(-1, groups.group_index.long())
    raise ValueError(f"element_scales does not know format {name!r}")
