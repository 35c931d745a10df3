"""The one dispatcher: how a payload's linear runs on a device, chosen once, then run per call.

Routes: ``"kernel"`` (qlens' fused Triton kernels), ``"dequantize"`` (a Triton dequantize
kernel, then cuBLAS: formats with no fused kernel) and ``"reference"`` (torch dequantize, then
matmul: the CPU, and anything the kernels cannot read). A :class:`LinearPlan` holds the checked
launch view and the launch chosen per row count, so a call does no payload checks, no table
walk and no device query. A W8A8 plan (block FP8 only) quantizes the activations to FP8 per
token and K block first, on every route.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.configs import LinearConfig
from qlens.kernels.dispatch import ACTIVATION_DTYPES, _weight_config, launch_kernel
from qlens.kernels.reference import reference_linear, reference_w8a8_linear
from qlens.kernels.runtime import kernel_device_problem
from qlens.kernels.weights import KernelWeight, cached_on_payload, kernel_weight, unsupported_reason
from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

logger = logging.getLogger(__name__)

Route = Literal["kernel", "dequantize", "reference"]
# Formats whose plans can quantize the activations too (W8A8).
W8A8_FORMATS = ("fp8_block",)
ROUTES = ("kernel", "dequantize", "reference")
# Launches kept per plan (one per row count seen); beyond this the table starts afresh.
_MAX_KEPT_CONFIGS = 512


def choose_route(payload: QuantPayload, device: torch.device) -> tuple[Route, str | None]:
    """The route for ``payload`` on ``device`` and, for the reference on an accelerator, why."""
    if device.type == "cpu":
        return "reference", None
    problem = kernel_device_problem(device)
    if problem is None:
        if unsupported_reason(payload) is None:
            return "kernel", None
        from qlens.kernels.dequant import has_dequantize_kernel  # Triton: when routes are chosen

        if has_dequantize_kernel(payload):
            return "dequantize", None
    return "reference", problem or unsupported_reason(payload) or "unsupported"


def w8a8_problem(fmt: QuantFormat, shape: Sequence[int]) -> str | None:
    """Why weights of format ``fmt`` and ``shape`` cannot run W8A8 (FP8 activations, one scale
    per token and K block of the weight), or None when they can."""
    if fmt.name not in W8A8_FORMATS:
        return (
            f"W8A8 (FP8 activations) runs {'/'.join(W8A8_FORMATS)} weights only; this weight is "
            f"{fmt.name}. Run it weight-only (w8a8=False)."
        )
    if tuple(fmt.block) == tuple(shape[-2:]) and tuple(fmt.block) != (128, 128):
        return (
            f"W8A8 takes the weight's K block as the activations' block; this {fmt.name} weight "
            f"{list(shape)} has one scale for the whole matrix (per-tensor), so it has none. "
            "Run it weight-only (w8a8=False)."
        )
    return None


def require_w8a8(fmt: QuantFormat, shape: Sequence[int]) -> None:
    """Raise :func:`w8a8_problem`'s reason, if any."""
    problem = w8a8_problem(fmt, shape)
    if problem is not None:
        raise ValueError(problem)


LaunchCall = Callable[[Tensor, Tensor | None], Tensor]


class LinearPlan:
    """``x @ W.T + bias`` for one payload on one device, on the route chosen when built.

    On the kernel route each (row count, activation dtype, bias or none) gets its launch
    prepared once (``prepared_gemv``: grid, strides, constants and the weight's tensors fixed),
    so a later call allocates the output and launches. ``route`` overrides the choice (the
    kernels under ``TRITON_INTERPRET=1`` on the CPU, in tests). ``w8a8=True``
    (``fp8_block`` payloads) quantizes the activations per token and K block to FP8 and
    multiplies on FP8 tensor cores, as ``reference_w8a8_linear`` computes. Built by :func:`plan_for`, which keeps it on the payload.
    """

    def __init__(
        self,
        payload: QuantPayload,
        device: torch.device,
        route: Route | None = None,
        *,
        w8a8: bool = False,
    ):
        if w8a8:
            require_w8a8(payload.format, payload.shape)
        reason = None
        if route is None:
            route, reason = choose_route(payload, device)
        elif route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.payload = payload
        self.device = device
        self.w8a8 = w8a8
        self.route: Route = route
        self.view: KernelWeight | None = kernel_weight(payload) if route == "kernel" else None
        self._configs: dict[int, LinearConfig] = {}
        # Prepared launches by (input shape, activation dtype, bias or none).
        self._calls: dict[tuple[torch.Size, torch.dtype, bool], LaunchCall] = {}
        self._values_checked = False
        if route == "reference" and device.type != "cpu":
            _warn_reference_on_accelerator(payload, device, reason or "unsupported")

    def __call__(
        self, x: Float[Tensor, "*batch k"], bias: Float[Tensor, " n"] | None = None
    ) -> Float[Tensor, "*batch n"]:
        """``x @ W.T + bias``; float64 activations (no kernel reads them) take the reference."""
        call = self._calls.get((x.shape, x.dtype, bias is None))
        if call is not None:  # a launch prepared for this input shape, dtype and bias
            return call(x, bias)
        if self.route == "kernel" and x.dtype in ACTIVATION_DTYPES:
            return self._kernel(x, bias)
        if self.w8a8:
            return reference_w8a8_linear(x, self.payload, bias)
        if self.route == "dequantize" and x.dtype in ACTIVATION_DTYPES:
            return self._dequantize(x, bias)
        return reference_linear(x, self.payload, bias)

    def config(self, m: int) -> LinearConfig:
        """The launch for ``m`` rows (chosen once per row count)."""
        config = self._configs.get(m)
        if config is None:
            assert self.view is not None, "only the kernel route has launches"
            if len(self._configs) >= _MAX_KEPT_CONFIGS:
                self._configs.clear()
            config = self._configs[m] = _weight_config(self.view, m, self.device, self.w8a8)
        return config

    def _kernel(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """The first call of an input shape, dtype and bias: checks, then prepares its launch."""
        w = self.view
        assert w is not None
        if x.shape[-1] != w.k:
            raise ValueError(
                f"input's last dim is {x.shape[-1]} but the weight has in_features {w.k} "
                f"(weight shape [{w.n}, {w.k}])"
            )
        if x.numel() == 0:
            return x.new_empty((*x.shape[:-1], w.n))
        return self._prepare(x.shape, x.dtype, bias is None)(x, bias)

    def _prepare(self, shape: torch.Size, dtype: torch.dtype, no_bias: bool) -> LaunchCall:
        """The launch for inputs of ``shape`` and ``dtype``, prepared and kept."""
        w = self.view
        assert w is not None, "only the kernel route has launches"
        m = shape.numel() // w.k
        out_shape = (*shape[:-1], w.n)
        config = self.config(m)
        call: LaunchCall
        if config.path == "gemv":
            from qlens.kernels.gemv import prepared_gemv  # Triton: once a launch is prepared

            call = prepared_gemv(w, m, dtype, not no_bias, config, out_shape, round_x=self.w8a8)
        elif config.path == "dequant" and not self.w8a8:
            from qlens.kernels.dequant import DequantizedLinear  # Triton: as above

            call = DequantizedLinear(w, dtype)
        elif config.path in ("splitk", "gemm") and not self.w8a8:
            from qlens.kernels.weight_only import PreparedWeightOnly  # Triton: as above

            call = PreparedWeightOnly(w, m, dtype, not no_bias, config, out_shape)
        else:
            call = functools.partial(_launch_on, w, config, out_shape, self.w8a8)
        if len(self._calls) >= _MAX_KEPT_CONFIGS:
            self._calls.clear()
        self._calls[shape, dtype, no_bias] = call
        return call

    def _dequantize(self, x: Tensor, bias: Tensor | None) -> Tensor:
        from qlens.kernels.dequant import dequantize_triton  # decodes the whole weight a call

        if self._values_checked:
            weight = dequantize_triton(self.payload, x.dtype, check_values=False)
        else:
            try:
                weight = dequantize_triton(self.payload, x.dtype)
            except ValueError as err:  # a layout the kernel refuses: the reference still runs
                self.route = "reference"
                _warn_reference_on_accelerator(self.payload, self.device, str(err))
                return reference_linear(x, self.payload, bias)
            self._values_checked = True
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _launch_on(
    w: KernelWeight,
    config: LinearConfig,
    out_shape: tuple[int, ...],
    w8a8: bool,
    x: Tensor,
    bias: Tensor | None,
) -> Tensor:
    return launch_kernel(x.reshape(-1, w.k), w, bias, config, w8a8).view(out_shape)


def plan_for(payload: QuantPayload, device: torch.device, *, w8a8: bool = False) -> LinearPlan:
    """The plan of ``payload`` on ``device``, kept on the payload (``cached_on_payload``): built
    on the first call and again only when the payload's tensors, format or layout change."""
    name = f"plan_{device}" + ("_w8a8" if w8a8 else "")
    return cached_on_payload(payload, name, lambda p: LinearPlan(p, device, w8a8=w8a8))


def linear(
    x: Float[Tensor, "*batch k"],
    payload: QuantPayload,
    bias: Float[Tensor, " n"] | None = None,
    *,
    w8a8: bool = False,
) -> Float[Tensor, "*batch n"]:
    """``x @ W.T + bias`` for the weight ``W`` that ``payload`` encodes, in ``x``'s dtype.

    The one dispatcher: on an accelerator, the fused kernels (``quantized_linear``) for the
    formats they read, a Triton dequantize then cuBLAS for formats with only a dequantize kernel
    (GGUF, BitNet), the torch reference otherwise (logged once per format); on the CPU, the
    torch reference (``reference_linear``). The choice and the checked launch view are made on
    the first call and kept on the payload. ``w8a8`` (FP8 activations for block FP8
    weights): see :class:`LinearPlan`.
    """
    return plan_for(payload, x.device, w8a8=w8a8)(x, bias)


_WARNED: set[tuple[str, str]] = set()


def _warn_reference_on_accelerator(
    payload: QuantPayload, device: torch.device, reason: str
) -> None:
    """Say once per format and reason that an accelerator runs the slow reference path."""
    key = (payload.format.name, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "qlens runs %s weights on %s with the torch reference (dequantize, then matmul), "
            "not its Triton kernels: %s",
            payload.format.name,
            device,
            reason,
        )
