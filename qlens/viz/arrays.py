"""Compact binary encodings of the arrays a viewer sends to the browser (once, as bytes)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

UINT8_LEVELS = 255


def float16_bytes(values: Tensor) -> bytes:
    """``values`` as little-endian float16, row-major (the browser decodes them to float32)."""
    return values.detach().to("cpu", torch.float32).numpy().astype("<f2").tobytes()


def unit_uint8_bytes(values: Tensor) -> bytes:
    """Values in ``[0, 1]`` (probabilities, attention weights) rounded to ``k / 255``, as uint8."""
    scaled = values.detach().to("cpu", torch.float32).clamp(0.0, 1.0).numpy() * UINT8_LEVELS
    return np.rint(scaled).astype(np.uint8).tobytes()


def uint32_bytes(values: Tensor) -> bytes:
    """Non-negative integers (e.g. indices into a string table) as little-endian uint32."""
    return values.detach().to("cpu", torch.int64).numpy().astype("<u4").tobytes()


def decode_float16(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array a browser reads back from :func:`float16_bytes`."""
    return np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(shape)


def decode_unit_uint8(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array a browser reads back from :func:`unit_uint8_bytes`."""
    levels = np.frombuffer(data, dtype=np.uint8).astype(np.float32)
    return (levels / UINT8_LEVELS).reshape(shape)
