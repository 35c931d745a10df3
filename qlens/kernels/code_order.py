"""Activations regrouped by code position for the packed 4-bit kernels on tensor cores (torch
only, one copy)."""

import torch
from jaxtyping import Float
from torch import Tensor


def regrouped_strides(k: int) -> tuple[int, int]:
    """The row and code-position strides of rows of ``k`` values regrouped by
    :func:`permute_codes` (``[m, 8, words]``, words padded to a multiple of four)."""
    words = -(-k // 32) * 4
    return 8 * words, words


def permute_codes(x: Float[Tensor, "m k"]) -> Float[Tensor, "m 8 words"]:
    """``x`` regrouped by code position, in its dtype: ``out[m, j, w] = x[m, 8 * w + j]``
    (zero-padded to a multiple of four words), so that code ``j`` of consecutive words is
    contiguous and a kernel's tensor-core dot for code position ``j`` reads it with wide loads
    in the words' own layout."""
    m, k = x.shape
    _, words = regrouped_strides(k)
    padded = torch.nn.functional.pad(x, (0, words * 8 - k)) if k % 32 else x
    return padded.view(m, words, 8).transpose(1, 2).contiguous()
