"""Mixture-of-experts linears: one launch per call for packed 4-bit experts in whole words (a
GEMV for few (token, expert) rows, the grouped GEMM beyond), else one launch per used expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.configs import choose_config
from qlens.kernels.dispatch import quantized_linear
from qlens.kernels.runtime import kernel_device_problem
from qlens.kernels.weights import (
    KernelWeight,
    cached_on_payload,
    kernel_weight,
    reads_payload_memory,
)
from qlens.quant.expert_payloads import num_experts_of, select_expert
from qlens.quant.payload import QuantPayload

if TYPE_CHECKING:
    from qlens.kernels.gemv import ExpertRows

# Up to this many (token, expert) rows, packed 4-bit experts in whole words run in one launch of
# the word-wise GEMV (each row reads its own expert's weight); more rows take one launch of the
# grouped GEMM (``grouped_experts``: rows sorted by expert, tiles of an expert's rows on tensor
# cores), which reads each expert's weight once per tile instead of once per row.
FUSED_EXPERT_ROWS = 64


def expert_views(payload: QuantPayload) -> tuple[QuantPayload, ...]:
    """The ``[out, in]`` payload of each expert of an ``[experts, out, in]`` payload (views,
    built once and kept on the payload, so each expert's launch plan is kept too)."""
    return cached_on_payload(
        payload,
        "expert_views",
        lambda p: tuple(select_expert(p, e) for e in range(num_experts_of(p))),
    )


def experts_in_one_launch(payloads: tuple[QuantPayload, ...], x: Tensor, rows: int) -> bool:
    """True when ``rows`` (token, expert) pairs of fused experts ``payloads`` ``[experts, out,
    in]`` can run all at once through :func:`experts_linear` on ``x``'s accelerator: up to
    ``FUSED_EXPERT_ROWS`` rows of formats the kernels read (one GEMV launch for packed 4-bit
    words, else one launch per used expert inside the call), more rows of packed 4-bit experts
    in whole words (one grouped launch)."""
    if x.device.type == "cpu" or rows <= 0:
        return False
    if kernel_device_problem(x.device) is not None:
        return False
    if rows <= FUSED_EXPERT_ROWS:
        return all(first_expert_view(p) is not None for p in payloads)
    return all(grouped_experts_read(p) for p in payloads)


def grouped_experts_read(payload: QuantPayload) -> bool:
    """Whether the grouped GEMM reads the ``[experts, out, in]`` payload: packed 4-bit experts
    in whole int32 words, contiguous (kept on the payload, ``cached_on_payload``)."""
    return cached_on_payload(
        payload,
        "grouped_experts_read",
        lambda p: stacked_experts(p, torch.empty(0, dtype=torch.int32)) is not None,
    )


def rows_through_experts(
    x: Float[Tensor, "rows k"],
    payload: QuantPayload,
    expert_ids: Integer[Tensor, " rows"],
    bias: Float[Tensor, "experts n"] | None = None,
) -> Float[Tensor, "rows n"]:
    """``out[i] = x[i] @ W[expert_ids[i]].T + bias[expert_ids[i]]`` with ids in
    ``[0, experts)``: :func:`experts_linear` on an accelerator (``experts_in_one_launch``), else
    each used expert through :func:`qlens.kernels.linear` on its rows."""
    if experts_in_one_launch((payload,), x, x.shape[0]):
        return experts_linear(x, payload, expert_ids, bias, ids_in_range=True)
    from qlens.kernels.plan import linear

    experts = expert_views(payload)
    out = x.new_empty((x.shape[0], int(payload.shape[1])))
    for expert in torch.unique(expert_ids).tolist():
        rows = torch.nonzero(expert_ids == expert).squeeze(1)
        out[rows] = linear(x[rows], experts[expert], None if bias is None else bias[expert])
    return out


def first_expert_view(payload: QuantPayload) -> KernelWeight | None:
    """The kernel view of expert 0 of an ``[experts, out, in]`` payload, or ``None`` for a
    format or layout the kernels do not read (then experts run one by one); kept on the payload
    (``cached_on_payload``)."""
    return cached_on_payload(
        payload,
        "first_expert_view",
        _build_first_expert_view,
        lambda view: reads_payload_memory(view, payload),
    )


def _build_first_expert_view(payload: QuantPayload) -> KernelWeight | None:
    try:
        return kernel_weight(select_expert(payload, 0))
    except ValueError:
        return None


def stacked_experts(
    payload: QuantPayload, expert_ids: Integer[Tensor, " t"]
) -> tuple[KernelWeight, ExpertRows] | None:
    """The kernel view of an ``[experts, out, in]`` packed 4-bit payload as its first expert's
    weight plus the rows' experts and the strides to them, or ``None`` when the one-launch GEMV
    cannot read it (other formats, rows that are not whole words, non-contiguous tensors)."""
    experts, n, k = (int(s) for s in payload.shape)
    tensors = [t for t in (payload.data, payload.scales, payload.zeros) if t is not None]
    g = payload.global_scale
    if not all(t.is_contiguous() for t in tensors) or (g is not None and not g.is_contiguous()):
        return None
    per_expert_global = g is not None and g.numel() == experts and experts > 1
    from qlens.kernels.gemv import ExpertRows, word_view

    w = first_expert_view(payload)
    if w is None or word_view(w) is None:
        return None
    rows = ExpertRows(
        ids=expert_ids.to(torch.int32).contiguous(),
        words=w.data.numel() // 4,
        scales=w.scales.numel(),
        global_scale=1 if per_expert_global else 0,
    )
    return w, rows


def experts_linear(
    x: Float[Tensor, "t k"],
    payload: QuantPayload,
    expert_ids: Integer[Tensor, " t"],
    bias: Float[Tensor, "e n"] | None = None,
    *,
    w8a8: bool = False,
    ids_in_range: bool = False,
) -> Float[Tensor, "t n"]:
    """``out[t] = x[t] @ W[expert_ids[t]].T + bias[expert_ids[t]]`` for an experts payload.

    Packed 4-bit experts in whole int32 words (int4, MXFP4, NVFP4) run in one launch: up to
    ``FUSED_EXPERT_ROWS`` rows through the word-wise GEMV, each row reading its own expert's
    weight (decode), more rows through the grouped GEMM (``grouped_experts_linear``: rows
    sorted by expert on the device, each expert's tiles on tensor cores; prefill). Other
    formats (fp8-block, MXFP8, int8, rows not in whole words) and ``w8a8`` sort the tokens by
    expert on the host and run ``quantized_linear`` once per used expert on its tokens (the
    dispatcher picks each launch's path by its count).

    The ids' range is checked on the host (one device sync) unless ``ids_in_range``: a caller
    whose ids lie in ``[0, experts)`` by construction (the modules' routing clamps them) passes
    it to keep the one-launch paths free of host syncs.
    """
    experts, n, k = (int(s) for s in payload.shape)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [tokens, {k}], got {list(x.shape)}")
    if expert_ids.shape != (x.shape[0],):
        raise ValueError(
            f"expert_ids must hold one expert per token, shape [{x.shape[0]}], got "
            f"{list(expert_ids.shape)}"
        )
    if expert_ids.numel() and not ids_in_range:
        low, high = (int(v) for v in torch.stack(torch.aminmax(expert_ids)).tolist())
        if low < 0 or high >= experts:
            raise ValueError(f"expert_ids must lie in [0, {experts}), got range [{low}, {high}]")
    fused = 0 < x.shape[0] <= FUSED_EXPERT_ROWS and not w8a8
    stacked = stacked_experts(payload, expert_ids) if fused else None
    if stacked is not None:
        from qlens.kernels.gemv import experts_gemv

        w, rows = stacked
        config = choose_config(1, n, k, x.device, packed_words=True)
        b = None if bias is None else bias.contiguous()
        return experts_gemv(x.contiguous(), w, rows, b, config)
    grouped = (
        stacked_experts(payload, expert_ids)
        if x.shape[0] > FUSED_EXPERT_ROWS and not w8a8
        else None
    )
    if grouped is not None:
        from qlens.kernels.grouped_experts import grouped_experts_linear

        w, rows = grouped
        b = None if bias is None else bias.contiguous()
        return grouped_experts_linear(x.contiguous(), w, rows, experts, b)
    out = x.new_empty((x.shape[0], n))
    views = expert_views(payload)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            token_rows = order[start : start + count]
            b = None if bias is None else bias[expert]
            out[token_rows] = quantized_linear(x[token_rows], views[expert], b, w8a8=w8a8)
            start += count
    return out
