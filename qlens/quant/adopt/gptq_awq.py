"""GPTQ and AWQ (GEMM) ``QuantLinear`` modules, recognised by their buffers.

Buffers ``qweight``/``qzeros``/``scales`` (+ ``g_idx`` for GPTQ). GPTQ packs ``qweight`` along K
(``[K*b/32, N]``), AWQ along N (``[K, N/8]``), which tells them apart. GPTQ zero points: modules
from gptqmodel hold the "gptq_v2" form in memory; other GPTQ modules (AutoGPTQ, checkpoints) the
on-disk v1 form (``zero - 1``); a module attribute ``checkpoint_format`` overrides this.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.codecs.bits import words_for
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload


def _features(module: nn.Module) -> tuple[int, int] | None:
    m: Any = module
    k = getattr(m, "in_features", getattr(m, "infeatures", None))
    n = getattr(m, "out_features", getattr(m, "outfeatures", None))
    return (int(n), int(k)) if k is not None and n is not None else None


def _buffers(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    qweight, qzeros, scales = (getattr(module, n, None) for n in ("qweight", "qzeros", "scales"))
    if not (
        isinstance(qweight, torch.Tensor)
        and isinstance(qzeros, torch.Tensor)
        and isinstance(scales, torch.Tensor)
    ):
        return None
    return (qweight, qzeros, scales) if qweight.dtype == torch.int32 else None


def _kind(module: nn.Module) -> str | None:
    buffers, dims = _buffers(module), _features(module)
    if buffers is None or dims is None:
        return None
    (n, k), qweight = dims, buffers[0]
    if qweight.shape == (k, words_for(n, 4)):
        return "awq"
    if qweight.shape[-1] == n and (qweight.shape[0] * 32) % k == 0:
        return "gptq"
    return None


def _group_size(module: nn.Module, k: int) -> int:
    group = int(getattr(module, "group_size", -1))
    return k if group in (-1, 0) else group


def _is_gptq(module: nn.Module) -> bool:
    return _kind(module) == "gptq"


def _is_awq(module: nn.Module) -> bool:
    return _kind(module) == "awq"


@register_adopter("GPTQ QuantLinear (qweight [K*b/32, N], qzeros, scales, g_idx)", _is_gptq)
def adopt_gptq(module: nn.Module) -> QuantPayload:
    qweight, qzeros, scales = _buffers(module)  # type: ignore[misc]
    n, k = _features(module)  # type: ignore[misc]
    bits = int(getattr(module, "bits", qweight.shape[0] * 32 // k))
    default = "gptq_v2" if type(module).__module__.startswith("gptqmodel") else "gptq"
    checkpoint_format = str(getattr(module, "checkpoint_format", default))
    extras = {}
    g_idx = getattr(module, "g_idx", None)
    if isinstance(g_idx, torch.Tensor):
        extras["g_idx"] = g_idx
    return QuantPayload(
        format=int_group_format(
            bits,
            _group_size(module, k),
            zero_point="int",
            scale_dtype=SCALE_DTYPE_NAMES[scales.dtype],
        ),
        data=qweight,
        shape=(n, k),
        scales=scales,
        zeros=qzeros,
        layout={"packing": "gptq", "checkpoint_format": checkpoint_format},
        extras=extras,
    )


@register_adopter("AWQ GEMM QuantLinear (qweight [K, N/8], qzeros, scales)", _is_awq)
def adopt_awq(module: nn.Module) -> QuantPayload:
    qweight, qzeros, scales = _buffers(module)  # type: ignore[misc]
    n, k = _features(module)  # type: ignore[misc]
    return QuantPayload(
        format=int_group_format(
            4, _group_size(module, k), zero_point="int", scale_dtype=SCALE_DTYPE_NAMES[scales.dtype]
        ),
        data=qweight,
        shape=(n, k),
        scales=scales,
        zeros=qzeros,
        layout={"packing": "awq"},
    )
