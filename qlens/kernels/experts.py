"""Mixture-of-experts linears in one launch per call: packed 4-bit experts in whole words take
a GEMV for few (token, expert) rows and the grouped GEMM beyond (bf16 prefill rows on Hopper:
every expert decoded once, then ``torch._grouped_mm``, ``decoded_experts``), one-byte experts
(fp8-block, MXFP8, int8) the grouped GEMM at every row count; other layouts and W8A8 run one
launch per used expert, which reads the routing on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from qlens.kernels.configs import LinearConfig, choose_config
from qlens.kernels.decoded_experts import (
    DECODED_EXPERTS_MIN_ROWS_PER_EXPERT,
    grouped_mm_device,
    stacked_rows_view,
)
from qlens.kernels.dispatch import ACTIVATION_DTYPES, quantized_linear
from qlens.kernels.gate_rule import GateRule
from qlens.kernels.launch import kernel_args
from qlens.kernels.packed_words import ExpertRows, ExpertStrides, word_view
from qlens.kernels.runtime import capturing_cuda_graph, kernel_device_problem
from qlens.kernels.weights import (
    KernelWeight,
    cached_on_payload,
    kernel_weight,
    reads_payload_memory,
    unsupported_reason,
)
from qlens.quant.expert_payloads import num_experts_of, select_expert
from qlens.quant.payload import QuantPayload

if TYPE_CHECKING:
    from typing import TypeAlias

    from qlens.kernels.decoded_experts import DecodedExperts
    from qlens.kernels.gemv import PackedGemv
    from qlens.kernels.grouped_experts import GroupedExperts
    from qlens.kernels.moe_decode import FusedMoeDecode

    ExpertsCall: TypeAlias = PackedGemv | GroupedExperts | DecodedExperts

# Up to this many (token, expert) rows, packed 4-bit experts in whole words run in one launch of
# the word-wise GEMV (each row reads its own expert's weight); more rows take one launch of the
# grouped GEMM (``grouped_experts``: rows sorted by expert, tiles of an expert's rows on tensor
# cores), which reads each expert's weight once per tile instead of once per row. One-byte
# experts (fp8-block, MXFP8, int8) take the grouped GEMM at any row count, as the dense
# weight-only path runs their few rows on tensor-core tiles (``"splitk"``).
FUSED_EXPERT_ROWS = 64
# Prepared launches kept per plan (one per row count, dtype and bias seen, prefill lengths
# among them); beyond this the table starts afresh.
_MAX_KEPT_CALLS = 512


def one_launch_schemes() -> list[str]:
    """The quantize schemes whose experts run in one launch per call (contiguous, packed rows
    in whole words): those of the formats whose experts the fused kernels read, from their
    codecs."""
    from qlens.kernels.formats import expert_kernel_formats
    from qlens.quant.codecs.registry import codec_for

    return [codec_for(name).scheme or name for name in expert_kernel_formats()]


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
    ``FUSED_EXPERT_ROWS`` rows of formats the kernels read (one launch for packed 4-bit words
    and one-byte experts, else one launch per used expert inside the call), more rows of the
    experts the grouped GEMM reads (one grouped launch)."""
    if x.device.type == "cpu" or rows <= 0:
        return False
    if kernel_device_problem(x.device) is not None:
        return False
    if rows <= FUSED_EXPERT_ROWS:
        return all(first_expert_view(p) is not None for p in payloads)
    return all(grouped_experts_read(p) for p in payloads)


def grouped_experts_read(payload: QuantPayload) -> bool:
    """Whether the grouped GEMM reads the ``[experts, out, in]`` payload: contiguous packed
    4-bit experts in whole int32 words or one-byte experts (kept on the payload,
    ``cached_on_payload``)."""
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

    require_no_graph_capture(payload, x.device, False)
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
    """The kernel view of an ``[experts, out, in]`` payload as its first expert's weight plus
    the rows' experts and the strides to them, or ``None`` when no one-launch path reads it
    (formats the kernels do not read, packed rows that are not whole words, non-contiguous
    tensors)."""
    stacked = stacked_view(payload)
    if stacked is None:
        return None
    w, strides = stacked
    return w, expert_rows(strides, expert_ids)


def expert_rows(strides: ExpertStrides, expert_ids: Integer[Tensor, " t"]) -> ExpertRows:
    """The rows' experts (as contiguous int32) with the experts' strides."""
    ids = expert_ids.to(torch.int32).contiguous()
    return ExpertRows(strides.data, strides.scales, strides.global_scale, ids)


def stacked_view(payload: QuantPayload) -> tuple[KernelWeight, ExpertStrides] | None:
    """``stacked_experts`` without the rows: the first expert's view and the experts' strides."""
    experts = int(payload.shape[0])
    tensors = [t for t in (payload.data, payload.scales, payload.zeros) if t is not None]
    g = payload.global_scale
    if not all(t.is_contiguous() for t in tensors) or (g is not None and not g.is_contiguous()):
        return None
    per_expert_global = g is not None and g.numel() == experts and experts > 1
    w = first_expert_view(payload)
    if w is None or (w.packed and word_view(w) is None):
        return None
    strides = ExpertStrides(
        data=w.data.numel() // 4 if w.packed else w.data.numel(),
        scales=w.scales.numel(),
        global_scale=1 if per_expert_global else 0,
    )
    return w, strides


class ExpertsPlan:
    """The projections of one ``[experts, out, in]`` payload on one device, prepared once.

    ``one_launch(rows)``: whether ``rows`` (token, expert) rows run in one launch here (an
    accelerator, a format the kernels read, few rows); ``rows(x, ids, bias)`` runs them, on
    the launch prepared once per (row count, dtype, bias or none) for contiguous experts (the
    word-wise GEMV for packed 4-bit words up to ``FUSED_EXPERT_ROWS`` rows, the grouped GEMM
    beyond and for one-byte experts), else through :func:`experts_linear`. ``fused_decode``
    prepares a whole block's decode with the down projection's plan (two launches). ``views``
    are the experts' own payloads. Built by :func:`experts_plan_for`, which keeps it on the
    payload.
    """

    def __init__(self, payload: QuantPayload, device: torch.device) -> None:
        experts, n, k = (int(s) for s in payload.shape)
        self.payload, self.device, self.num_experts = payload, device, experts
        self._accelerated = (
            device.type != "cpu"
            and kernel_device_problem(device) is None
            and first_expert_view(payload) is not None
        )
        self.stacked = stacked_view(payload)
        self._config = choose_config(1, n, k, device, packed_words=True)
        self._calls: dict[tuple[int, torch.dtype, bool], ExpertsCall] = {}
        self._grouped: dict[tuple[int, torch.dtype, bool], GroupedExperts] = {}  # among _calls
        self._views: tuple[QuantPayload, ...] | None = None
        self._rows_view: KernelWeight | None = None
        self._decoded: DecodedExperts | None = None  # bf16 only
        # The fused decodes prepared with the down projection of ``_fused_down`` (one at a time)
        self._fused: dict[tuple[object, ...], FusedMoeDecode | None] = {}
        self._fused_down: ExpertsPlan | None = None
        if self.stacked is not None and grouped_mm_device(device):
            self._rows_view = stacked_rows_view(*self.stacked, experts)

    @property
    def views(self) -> tuple[QuantPayload, ...]:
        """The experts' own payloads (built on first use and kept: a plan built for each call
        of a compiled forward does not pay for them)."""
        if self._views is None:
            self._views = expert_views(self.payload)
        return self._views

    def one_launch(self, rows: int) -> bool:
        """Few rows through the word-wise GEMV (packed 4-bit words) or the grouped GEMM
        (one-byte experts), more through the grouped GEMM; other formats the kernels read run
        expert by expert inside the call, up to ``FUSED_EXPERT_ROWS`` rows."""
        if not self._accelerated or rows <= 0:
            return False
        return rows <= FUSED_EXPERT_ROWS or self.stacked is not None

    def rows(
        self,
        x: Float[Tensor, "t k"],
        expert_ids: Integer[Tensor, " t"],
        bias: Float[Tensor, "e n"] | None,
    ) -> Float[Tensor, "t n"]:
        """``out[t] = x[t] @ W[expert_ids[t]].T + bias[expert_ids[t]]``, ids in range (unchecked)."""
        call = self._calls.get((x.shape[0], x.dtype, bias is None))
        if call is None:
            if self.stacked is None or x.shape[0] == 0:
                return experts_linear(x, self.payload, expert_ids, bias, ids_in_range=True)
            call = self._prepare(x.shape[0], x.dtype, bias is None)
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        return call(x, bias, expert_ids)

    def grouped(self, m: int, dtype: torch.dtype, no_bias: bool) -> GroupedExperts | None:
        """The grouped launch ``m`` rows of ``dtype`` take here (prepared once and kept), or
        ``None`` when they take another: a caller sorting the rows itself runs it through
        ``GroupedExperts.on_order``."""
        if self.stacked is None or m <= 0:
            return None
        key = (m, dtype, no_bias)
        if key not in self._calls:
            self._prepare(m, dtype, no_bias)
        return self._grouped.get(key)

    def fused_decode(
        self,
        down: ExpertsPlan,
        rule: GateRule,
        tokens: int,
        top_k: int,
        dtype: torch.dtype,
        biases: tuple[bool, bool],
    ) -> FusedMoeDecode | None:
        """The two-launch decode (``qlens.kernels.moe_decode``) of ``tokens`` tokens routed to
        ``top_k`` experts each, this plan's payload the gate|up projection and ``down``'s the
        down one, or ``None`` where the unfused launches run instead: more than
        ``FUSED_EXPERT_ROWS`` routed rows, experts not stacked as the kernels read them
        (``stacked_view``), no accelerator. ``biases``: whether each projection has one.
        Prepared once per shape and kept (the answer too) while ``down`` stays the same plan."""
        if down is not self._fused_down:
            self._fused.clear()
            self._fused_down = down
        key = (tokens, top_k, dtype, biases, rule)
        try:
            return self._fused[key]
        except KeyError:
            pass
        fused = None
        if self._fuses_with(down, tokens * top_k, dtype):
            from qlens.kernels.moe_decode import FusedMoeDecode  # Triton: on a GPU only

            fused = FusedMoeDecode(
                self._fused_side(), down._fused_side(), self.num_experts, rule, tokens, top_k,
                dtype, biases,
            )  # fmt: skip
        if len(self._fused) >= _MAX_KEPT_CALLS:
            self._fused.clear()
        self._fused[key] = fused
        return fused

    def _fuses_with(self, down: ExpertsPlan, rows: int, dtype: torch.dtype) -> bool:
        return (
            0 < rows <= FUSED_EXPERT_ROWS
            and dtype in ACTIVATION_DTYPES
            and self.num_experts == down.num_experts
            and self._accelerated
            and down._accelerated
            and self.stacked is not None
            and down.stacked is not None
        )

    def _fused_side(self) -> tuple[KernelWeight, Tensor, ExpertStrides, LinearConfig]:
        """What the fused decode reads of this projection: its first expert view, the data the
        kernels read (int32 words of packed 4-bit codes, or bytes), the experts' strides and
        the one-row GEMV's config of one expert."""
        assert self.stacked is not None
        w, strides = self.stacked
        if w.packed:
            words = word_view(w)
            assert words is not None  # stacked_view takes packed rows of whole words only
            return w, words, strides, self._config
        return w, kernel_args(w)[0], strides, choose_config(1, w.n, w.k, self.device)

    def _decodes_experts(self, m: int, dtype: torch.dtype) -> bool:
        """Whether ``m`` rows of ``dtype`` take :class:`DecodedExperts`: bf16 prefill rows (at
        least ``DECODED_EXPERTS_MIN_ROWS_PER_EXPERT`` an expert on average) on a device whose
        ``torch._grouped_mm`` runs grouped, packed 4-bit experts (one-byte experts keep the
        grouped kernel, faster there) readable as stacked rows whose decoded rows and columns
        lie on 16 bytes (``torch._grouped_mm``'s alignment)."""
        view = self._rows_view
        return (
            view is not None
            and view.packed
            and dtype == torch.bfloat16
            and m >= DECODED_EXPERTS_MIN_ROWS_PER_EXPERT * self.num_experts
            and view.k % 8 == 0
            and (view.n // self.num_experts) % 8 == 0
        )

    def decoded(self, m: int, dtype: torch.dtype) -> DecodedExperts | None:
        """The :class:`DecodedExperts` that ``m`` rows of ``dtype`` take here, or ``None`` when
        they take another launch (kept once built)."""
        if not self._decodes_experts(m, dtype):
            return None
        if self._decoded is None:
            from qlens.kernels.decoded_experts import DecodedExperts

            assert self._rows_view is not None
            self._decoded = DecodedExperts(self._rows_view, self.num_experts, dtype)
        return self._decoded

    def _prepare(self, m: int, dtype: torch.dtype, no_bias: bool) -> ExpertsCall:
        # Triton: imported once a launch is prepared
        from qlens.kernels.gemv import PackedGemv
        from qlens.kernels.grouped_experts import GroupedExperts

        assert self.stacked is not None
        w, strides = self.stacked
        if len(self._calls) >= _MAX_KEPT_CALLS:
            self._calls.clear()
            self._grouped.clear()
        key = (m, dtype, no_bias)
        call: ExpertsCall
        if w.packed and m <= FUSED_EXPERT_ROWS:
            words = word_view(w)
            assert words is not None  # stacked_view takes packed rows of whole words only
            call = PackedGemv(w, words, m, dtype, not no_bias, self._config, strides)
        elif (decoded := self.decoded(m, dtype)) is not None:  # decode, then a grouped GEMM
            call = decoded
        else:  # one byte an element, or prefill rows: the grouped GEMM
            call = self._grouped[key] = GroupedExperts(
                w, strides, self.num_experts, m, dtype, not no_bias
            )
        self._calls[key] = call
        return call


def experts_plan_for(payload: QuantPayload, device: torch.device) -> ExpertsPlan:
    """The :class:`ExpertsPlan` of ``payload`` on ``device``, kept on the payload
    (``cached_on_payload``) until its tensors, format or layout change."""
    return cached_on_payload(payload, f"experts_plan_{device}", lambda p: ExpertsPlan(p, device))


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

    Runs in one launch (no host sync) for contiguous experts of the ``one_launch_schemes()``:
    packed 4-bit experts in whole int32 words (int4, MXFP4, NVFP4) up to ``FUSED_EXPERT_ROWS``
    rows through the word-wise GEMV, each row reading its own expert's weight (decode); more
    rows, and one-byte experts (fp8-block, MXFP8, int8) at any row count, through the grouped
    GEMM (``grouped_experts_linear``: rows sorted by expert on the device, each expert's tiles
    on tensor cores). bf16 rows of packed 4-bit experts, ``DECODED_EXPERTS_MIN_ROWS_PER_EXPERT``
    or more an expert, on a GPU whose ``torch._grouped_mm`` runs grouped, instead decode every
    expert once (one launch) and run ``torch._grouped_mm`` (``DecodedExperts``). Other layouts
    (packed rows not in whole words, non-contiguous tensors) and ``w8a8`` sort the tokens by
    expert on the host and run ``quantized_linear`` once per used expert on its tokens (the
    dispatcher picks each launch's path by its count); that host read cannot run under CUDA
    graph capture, which raises ``RuntimeError``.

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
        if capturing_cuda_graph(x.device):
            raise RuntimeError(
                "experts_linear checks the expert ids' range on the host, which a CUDA graph "
                "capture cannot; pass ids_in_range=True when the ids lie in [0, experts) by "
                "construction (clamped by the routing)"
            )
        low, high = (int(v) for v in torch.stack(torch.aminmax(expert_ids)).tolist())
        if low < 0 or high >= experts:
            raise ValueError(f"expert_ids must lie in [0, {experts}), got range [{low}, {high}]")
    plan = experts_plan_for(payload, x.device) if x.shape[0] and not w8a8 else None
    if plan is not None and plan.stacked is not None:
        if x.shape[0] > FUSED_EXPERT_ROWS:
            from qlens.kernels.grouped_experts import check_grouped_inputs  # Triton, first use

            check_grouped_inputs(x, plan.stacked[0], experts, bias)
        return plan.rows(x.contiguous(), expert_ids.contiguous(), bias)
    require_no_graph_capture(payload, x.device, w8a8)
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


def require_no_graph_capture(payload: QuantPayload, device: torch.device, w8a8: bool) -> None:
    """Raise ``RuntimeError`` when experts that run one by one (a host read of the routing)
    would run under CUDA graph capture, saying why they do and what runs instead."""
    if not capturing_cuda_graph(device):
        return
    why = "W8A8" if w8a8 else one_launch_refusal(payload, device)
    raise host_routing_under_capture(
        f"{payload.format.name} experts of shape {list(payload.shape)} run one launch per used "
        f"expert ({why})"
    )


def host_routing_under_capture(what: str) -> RuntimeError:
    """The error for experts that read the routing on the host during a CUDA graph capture;
    ``what`` says which experts run one by one and why."""
    return RuntimeError(
        f"{what}, which reads the routing on the host, and a CUDA graph capture cannot: compile "
        "without CUDA graphs (torch.compile(model, mode='default')), or quantize the experts "
        f"with a scheme whose experts run in one launch ({', '.join(one_launch_schemes())}; "
        "contiguous, packed 4-bit rows in whole 32-bit words)"
    )


def one_launch_refusal(payload: QuantPayload, device: torch.device) -> str:
    """Why no one-launch path runs the ``[experts, out, in]`` payload on ``device``."""
    problem = kernel_device_problem(device)
    if problem is not None:
        return problem
    w = first_expert_view(payload)
    if w is None:
        return unsupported_reason(select_expert(payload, 0)) or "a layout the kernels do not read"
    if w.packed and word_view(w) is None:
        return f"packed 4-bit rows of {w.data.shape[-1]} bytes, not whole 32-bit words"
    return "non-contiguous tensors; call .contiguous() on them"
