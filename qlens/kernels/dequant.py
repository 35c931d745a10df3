"""GPU dequantize kernels: a qlens payload to a dense float matrix, bit-exact with the codecs."""

from typing import no_type_check

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from qlens.kernels.decode import decode_byte_tile, decode_packed_halves
from qlens.kernels.dequant_launch import DequantLaunch, k_first_grid, k_first_tile
from qlens.kernels.fast_launch import FastLaunch
from qlens.kernels.formats import kernel_support
from qlens.kernels.launch import kernel_args, kernel_constants, on_device
from qlens.kernels.numerics import cast_out
from qlens.kernels.runtime import interpreting, require_kernel_device
from qlens.kernels.weights import KernelWeight, kernel_weight, unsupported_reason
from qlens.quant.payload import QuantPayload

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
@no_type_check
def _dequant_kernel(
    data_ptr,
    scale_ptr,
    zero_ptr,
    global_ptr,
    out_ptr,
    N,
    K,
    stride_d,
    stride_s,
    stride_o,
    FAMILY: tl.constexpr,
    PACKED: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GLOBAL_DIVIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row_tile, k_tile = k_first_tile(K, BLOCK_K)
    offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = k_tile * BLOCK_K
    if PACKED:
        even, odd = decode_packed_halves(
            data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
            FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
        )  # fmt: skip
        w = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
    else:
        w = decode_byte_tile(
            data_ptr, scale_ptr, zero_ptr, global_ptr, offs_n, k0, N, K, stride_d, stride_s,
            FAMILY, GROUP_N, GROUP_K, SCALE_E8M0, HAS_ZEROS, GLOBAL_DIVIDE, BLOCK_N, BLOCK_K, EVEN_K,
        )  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    tl.store(
        out_ptr + offs_n[:, None] * stride_o + offs_k[None, :],
        cast_out(w, out_ptr.dtype.element_ty, INTERPRET),
        mask=mask,
    )


_DEQUANT = FastLaunch(_dequant_kernel)


# GPU default: the best tile overall of the sweep in benchmarks/results/dequant_h200.md (H200,
# programs in K-first order): 89-94% of the copy ceiling for every scheme.
GPU_DEQUANT_LAUNCH = DequantLaunch(32, 256, 4)


def default_launch(n: int) -> DequantLaunch:
    """Few huge tiles in the interpreter (it pays per program), the tuned tile on a GPU."""
    if interpreting():
        return DequantLaunch(max(16, min(64, triton.next_power_of_2(n))), 128, 4)
    return GPU_DEQUANT_LAUNCH


def has_dequantize_kernel(payload: QuantPayload) -> bool:
    """Whether ``dequantize_triton`` has a kernel for ``payload``'s format and layout: its
    format has a Triton dequantize and, where that kernel reads the launch view, the payload
    fits it."""
    support = kernel_support(payload.format.name)
    if support is None or support.triton_dequantize is None:
        return False
    if support.view is None or support.dequantize_reads_any_layout:
        return True
    return unsupported_reason(payload) is None


def dequantize_triton(
    payload: QuantPayload,
    dtype: torch.dtype = torch.bfloat16,
    *,
    launch: DequantLaunch | None = None,
    check_values: bool = True,
) -> Float[Tensor, "..."]:
    """Dense ``[out, in]`` (or ``[experts, out, in]``) weight of ``payload`` in ``dtype``.

    Decoded by the Triton kernel of its format (``KernelSupport.triton_dequantize``, see
    ``qlens.kernels.formats``: the qlens layouts of the kernel families, bitsandbytes, GGUF
    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and BitNet), bit-exact with ``qlens.dequantize(payload, dtype)``.
    ``launch`` overrides the default tile (benchmarks sweep it); each library
    kernel's docstring says how it reads the tile. ``check_values=False`` skips the library
    layouts' checks of their values (non-finite scales, codes out of range: one device sync
    each), for payloads already checked.
    """
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dequantize_triton outputs {list(_OUT_DTYPES)}, not {dtype}")
    support = kernel_support(payload.format.name)
    if support is None or support.triton_dequantize is None:
        kernel_weight(payload)  # raises, naming the formats the kernels read
        raise ValueError(f"no Triton dequantize kernel for format {payload.format.name!r}")
    return support.triton_dequantize(payload, dtype, launch=launch, check_values=check_values)


def dequantize_qlens_layout(
    payload: QuantPayload,
    dtype: torch.dtype,
    *,
    launch: DequantLaunch | None = None,
    check_values: bool = True,
) -> Float[Tensor, "..."]:
    """``dequantize_triton`` of a payload in the qlens layout of a kernel family (experts one
    by one); ``check_values`` has nothing to skip here (the view checks no values)."""
    if len(payload.shape) == 3:
        from qlens.quant.expert_payloads import select_expert

        experts = range(payload.shape[0])
        return torch.stack(
            [
                dequantize_qlens_layout(select_expert(payload, e), dtype, launch=launch)
                for e in experts
            ]
        )
    w = kernel_weight(payload)
    require_kernel_device(w.data.device)
    return dequantize_view(w, dtype, launch)


def dequantize_view(
    w: KernelWeight,
    dtype: torch.dtype,
    launch: DequantLaunch | None = None,
    out: Float[Tensor, "n k"] | None = None,
) -> Float[Tensor, "n k"]:
    """``dequantize_triton`` of a checked launch view (no checks: the caller made them), into
    ``out`` (rows of stride ``out.stride(0)``, contiguous columns) when given."""
    if out is None:
        out = torch.empty((w.n, w.k), dtype=dtype, device=w.data.device)
    grid, args, options = _dequant_launch(w, out, out.stride(0), launch or default_launch(w.n))
    with on_device(out.device):
        _DEQUANT.launch(grid, *args, **options)
    return out


def _dequant_launch(
    w: KernelWeight, out: Tensor, stride_o: int, tile: DequantLaunch
) -> tuple[tuple[int], tuple, dict]:
    """The grid, positional arguments and keyword constants of the dequantize kernel decoding
    ``w`` into ``out`` (rows ``stride_o`` apart) with ``tile``; ``out`` is argument 4."""
    args = (*kernel_args(w), out, w.n, w.k, w.data.stride(0), w.scales.stride(0), stride_o)
    options = dict(
        **kernel_constants(w), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=w.k % tile.block_k == 0, INTERPRET=interpreting(), num_warps=tile.num_warps,
    )  # fmt: skip
    return k_first_grid(w.n, w.k, tile.block_n, tile.block_k), args, options


class PreparedDequantize:
    """``dequantize_view(w, dtype)`` prepared once: grid, strides, constants and the weight's
    tensors fixed, so a call allocates the output and launches with only its address passed.
    No checks (the caller made them)."""

    def __init__(self, w: KernelWeight, dtype: torch.dtype) -> None:
        self.shape, self.dtype, self.device = (w.n, w.k), dtype, w.data.device
        # w.data holds the output's place (argument 4) until a call passes the output
        grid, args, options = _dequant_launch(w, w.data, w.k, default_launch(w.n))
        self.launch = _DEQUANT.prepare(grid, args, [4], self.device, **options)

    def __call__(self) -> Float[Tensor, "n k"]:
        weight = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.launch(weight)
        return weight


class DequantizedLinear:
    """``x @ W.T + bias`` on the ``"dequant"`` path for activations of ``dtype``: the weight
    decoded by a :class:`PreparedDequantize`, then cuBLAS."""

    def __init__(self, w: KernelWeight, dtype: torch.dtype) -> None:
        self.decode, self.dtype = PreparedDequantize(w, dtype), dtype

    def __call__(
        self, x: Float[Tensor, "*batch k"], bias: Float[Tensor, " n"] | None
    ) -> Float[Tensor, "*batch n"]:
        return F.linear(x, self.decode(), None if bias is None else bias.to(self.dtype))
