"""Public entry points: run a quantized linear on the best Triton path for its shape."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.configs import LinearConfig, choose_config
from qlens.kernels.layout_view import BNB4, INT4
from qlens.kernels.runtime import kernel_device_problem, require_kernel_device
from qlens.kernels.weights import (
    KernelWeight,
    cached_on_payload,
    kernel_weight,
    unsupported_reason,
)
from qlens.quant.payload import QuantPayload

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(payload: QuantPayload, device: torch.device | str) -> bool:
    """True when ``quantized_linear`` can run ``payload`` on ``device``."""
    return (
        kernel_device_problem(torch.device(device)) is None and unsupported_reason(payload) is None
    )


def default_config(
    payload: QuantPayload,
    m: int,
    device: torch.device,
    *,
    w8a8: bool = False,
    words: bool = True,
) -> LinearConfig:
    """The launch ``quantized_linear`` chooses for ``m`` rows against ``payload`` on ``device``;
    ``words=False`` chooses as for the byte-wise kernels (packed words not read as words)."""
    return _weight_config(kernel_weight(payload), m, device, w8a8, words)


def _weight_config(
    w: KernelWeight,
    m: int,
    device: torch.device,
    w8a8: bool,
    words: bool = True,
) -> LinearConfig:
    """``default_config`` for the payload's launch view ``w``."""
    from qlens.kernels.packed_words import word_view

    packed_words = words and not w8a8 and word_view(w) is not None
    # Symmetric int4 only: the packed GEMV's longer reach was measured without zero points.
    int4 = w.family == INT4 and w.zeros is None
    config = choose_config(
        m, w.n, w.k, device, w8a8=w8a8, packed_words=packed_words, int4=int4,
        table_codes=w.family == BNB4,
    )  # fmt: skip
    return config if words else replace(config, words=False)


def quantized_linear(
    x: Float[Tensor, "*batch k"],
    payload: QuantPayload,
    bias: Float[Tensor, " n"] | None = None,
    *,
    w8a8: bool = False,
    config: LinearConfig | None = None,
) -> Float[Tensor, "*batch n"]:
    """``x @ W.T + bias`` for the weight ``payload`` encodes, computed by Triton kernels.

    By default the weight is decoded to ``x``'s dtype (bf16, fp16 or fp32) inside the kernel, so
    the result matches ``reference_linear`` up to the matmul's rounding. ``w8a8=True`` (fp8_block
    only) also quantizes the activations per token and K block to FP8 and runs an FP8 tensor-core
    GEMM; it matches ``reference_w8a8_linear``. ``config`` overrides the launch the dispatcher
    would choose (``default_config``). Runs on CUDA devices, or on the CPU under
    ``TRITON_INTERPRET=1``; elsewhere use ``qlens.kernels.reference_linear``.
    """
    require_kernel_device(x.device)
    w = kernel_weight(payload)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"quantized_linear takes {[str(d) for d in ACTIVATION_DTYPES]} activations, got "
            f"{x.dtype}; cast the input first"
        )
    if x.shape[-1] != w.k:
        raise ValueError(
            f"input's last dim is {x.shape[-1]} but the weight has in_features {w.k} "
            f"(weight shape [{w.n}, {w.k}])"
        )
    if w.data.device != x.device:
        raise ValueError(
            f"input is on {x.device} but the quantized weight is on {w.data.device}; move one "
            "of them (payload.to(device))"
        )
    if bias is not None and (bias.shape != (w.n,) or bias.device != x.device):
        raise ValueError(
            f"bias must have shape [{w.n}] on {x.device}, got {list(bias.shape)} on {bias.device}"
        )
    x2 = x.reshape(-1, w.k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], w.n))
    if config is None:
        config = _weight_config(w, m, x.device, w8a8)
    return launch_kernel(x2, w, bias, config, w8a8).reshape(*x.shape[:-1], w.n)


def launch_kernel(
    x2: Float[Tensor, "m k"],
    w: KernelWeight,
    bias: Float[Tensor, " n"] | None,
    config: LinearConfig,
    w8a8: bool = False,
) -> Float[Tensor, "m n"]:
    """Run the launch ``config`` of ``x2 @ W.T + bias`` on a checked view ``w``; no checks (the
    callers made them once), ``x2`` has at least one row."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if config.path == "gemv":  # W8A8's one row: the GEMV reads it rounded to FP8
        from qlens.kernels.gemv import gemv_linear

        return gemv_linear(x2, w, bias, config, round_x=w8a8)
    if w8a8:
        from qlens.kernels.fp8_w8a8 import fp8_block_w8a8_linear

        return fp8_block_w8a8_linear(x2, w, bias, config)
    if config.path == "dequant":
        from qlens.kernels.dequant import dequantize_view

        b = None if bias is None else bias.to(x2.dtype)
        return F.linear(x2, dequantize_view(w, x2.dtype), b)
    from qlens.kernels.weight_only import weight_only_linear

    return weight_only_linear(x2, w, bias, config)


def dequantized_linear(
    x: Float[Tensor, "*batch k"],
    payload: QuantPayload,
    bias: Float[Tensor, " n"] | None = None,
) -> Float[Tensor, "*batch n"]:
    """``x @ W.T + bias`` with ``W`` decoded by ``dequantize_triton`` in ``x``'s dtype (bit-exact
    with ``qlens.dequantize``), then a cuBLAS matmul: the GPU route for payloads whose format
    has a dequantize kernel but no fused linear (GGUF Q4_1/Q5_0/Q5_1, BitNet), or a layout the
    fused kernels refuse (bitsandbytes 4-bit blocks straddling rows).

    The payload's values are checked on the first call only (and again once its tensors or
    layout change), so later calls make no device sync."""
    from qlens.kernels.dequant import dequantize_triton

    require_kernel_device(x.device)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"dequantized_linear takes {[str(d) for d in ACTIVATION_DTYPES]} activations, got "
            f"{x.dtype}; cast the input first"
        )
    checked: list[Tensor] = []

    def first_call(p: QuantPayload) -> bool:
        checked.append(dequantize_triton(p, x.dtype))
        return True

    cached_on_payload(payload, "values_checked", first_call)
    weight = checked[0] if checked else dequantize_triton(payload, x.dtype, check_values=False)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
