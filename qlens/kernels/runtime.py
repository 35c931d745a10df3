"""Where Triton kernels can run: a CUDA device, or the CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (looked up once)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # ``sys.modules["triton"] = None`` blocks it
        return False


def kernel_device_problem(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device``, or ``None`` when they can."""
    if not triton_available():
        return "the 'triton' package is not installed (pip install 'qlens[triton]')"
    if device.type == "cuda":
        if interpreting():
            return "TRITON_INTERPRET=1 is set, so Triton only runs CPU tensors"
        return None
    if device.type == "cpu" and interpreting():
        return None
    return (
        f"Triton kernels need a CUDA device (got {device.type!r}); on the CPU use "
        "qlens.kernels.reference_linear / qlens.dequantize, or set TRITON_INTERPRET=1 to run "
        "the kernels slowly in Triton's interpreter"
    )


def require_kernel_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` explaining why Triton kernels cannot run on ``device``."""
    problem = kernel_device_problem(device)
    if problem is not None:
        raise RuntimeError(f"qlens Triton kernels cannot run: {problem}")


def cuda_index(device: torch.device) -> int:
    """The index of CUDA ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def gpu_name(device: torch.device) -> str:
    """The accelerator's name (``"cpu-interpreter"`` on the CPU); read once per GPU."""
    if device.type == "cuda":
        return _cuda_name(cuda_index(device))
    return "cpu-interpreter"


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def capturing_cuda_graph(device: torch.device) -> bool:
    """Whether the current stream of ``device`` (a CUDA device) is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def current_stream(device: torch.device) -> int:
    """The handle of ``device``'s current stream (a CUDA device; 0 elsewhere), without building
    a ``torch.cuda.Stream``."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(cuda_index(device))
