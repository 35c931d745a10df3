"""Activations regrouped by code position for the packed 4-bit GEMV, and back (torch only, so a
compiled graph can hold the regrouping where inductor fuses it into the op that made ``x``)."""

import torch
from jaxtyping import Float
from torch import Tensor


def regrouped_strides(k: int) -> tuple[int, int]:
    """The row and code-position strides of rows of ``k`` values regrouped by
    :func:`permute_codes` (``[m, 8, words]``, words padded to a multiple of four)."""
    words = -(-k // 32) * 4
    return 8 * words, words


def permute_codes(x: Float[Tensor, "m k"], *, for_dot: bool) -> Float[Tensor, "m 8 words"]:
    """``x`` regrouped for the packed GEMV by code position: ``out[m, j, w] = x[m, 8 * w + j]``
    (zero-padded to a multiple of four words), so that code ``j`` of consecutive words is
    contiguous and the kernel reads it with wide loads in the words' own layout. float32 for
    the FMA kernel, ``x``'s dtype for the tensor-core kernel."""
    m, k = x.shape
    _, words = regrouped_strides(k)
    padded = torch.nn.functional.pad(x, (0, words * 8 - k)) if k % 32 else x
    grouped = padded.view(m, words, 8).transpose(1, 2)
    if for_dot or x.dtype == torch.float32:
        return grouped.contiguous()  # one copy, no separate allocation call
    return grouped.to(torch.float32, memory_format=torch.contiguous_format)


def restore_codes(
    regrouped: Float[Tensor, "m 8 words"], k: int, dtype: torch.dtype
) -> Float[Tensor, "m k"]:
    """The rows ``permute_codes`` regrouped, as ``[m, k]`` of ``dtype`` (exact when ``dtype`` is
    the one they had: regrouping widens to float32 or keeps the dtype)."""
    m, _, words = regrouped.shape
    return regrouped.transpose(1, 2).reshape(m, words * 8)[:, :k].to(dtype)
