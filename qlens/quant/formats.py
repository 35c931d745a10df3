"""Quantization formats as pure data: what a packed weight means, independent of any tensor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    """A weight quantization format.

    ``block`` is the (rows, cols) extent of the weight region that shares one scale, in logical
    ``[out, in]`` coordinates: ``(128, 128)`` for block FP8, ``(1, 32)`` for MX, ``(1, 16)`` for NVFP4,
    ``(1, group_size)`` for group-wise integers, ``(1, in)`` for per-row, ``(0, 0)`` for per-tensor.
    """

    name: str
    element: str  # "e4m3", "e2m1", "int4", "int8", "nf4", "fp4_bnb", "ternary", "higgs_vq", ...
    bits: int  # storage bits per weight element, excluding scales
    block: tuple[int, int]
    scale_dtype: str  # "fp32", "e8m0", "e4m3", "fp16", "bf16", "none"
    zero_point: str = "none"  # "none" | "int" | "float"
    global_scale: str = "none"  # "none" | "multiply" | "divide"
    description: str = ""

    def __str__(self) -> str:
        return self.name


def fp8_block_format(block: tuple[int, int] = (128, 128), scale_dtype: str = "fp32") -> QuantFormat:
    """Block FP8: e4m3 elements, one fp32 or E8M0 multiplier per ``block`` (rows, cols) tile."""
    if scale_dtype not in ("fp32", "e8m0"):
        raise ValueError(f"fp8_block scale_dtype must be 'fp32' or 'e8m0', got {scale_dtype!r}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"fp8_block block must be two positive ints (rows, cols), got {block}")
    return QuantFormat(
        name="fp8_block",
        element="e4m3",
        bits=8,
        block=(int(block[0]), int(block[1])),
        scale_dtype=scale_dtype,
        description=f"FP8 e4m3 with a {scale_dtype} scale per {block[0]}x{block[1]} block",
    )


MXFP8 = QuantFormat(
    name="mxfp8",
    element="e4m3",
    bits=8,
    block=(1, 32),
    scale_dtype="e8m0",
    description="OCP MXFP8: e4m3 elements, one E8M0 scale per 32 along K",
)

MXFP4 = QuantFormat(
    name="mxfp4",
    element="e2m1",
    bits=4,
    block=(1, 32),
    scale_dtype="e8m0",
    description="OCP MXFP4: e2m1 elements two per byte, one E8M0 scale per 32 along K",
)


def nvfp4_format(global_scale: str = "multiply") -> QuantFormat:
    """NVFP4: e2m1 elements, e4m3 scale per 16 along K, fp32 global (multiplied or divided)."""
    if global_scale not in ("multiply", "divide"):
        raise ValueError(
            f"nvfp4 global_scale must be 'multiply' (W = fp4*s*g, ModelOpt/torchao) or 'divide' "
            f"(W = fp4*s/g, compressed-tensors), got {global_scale!r}"
        )
    return QuantFormat(
        name="nvfp4",
        element="e2m1",
        bits=4,
        block=(1, 16),
        scale_dtype="e4m3",
        global_scale=global_scale,
        description=f"NVFP4: e2m1 elements, e4m3 scale per 16 along K, global scale ({global_scale})",
    )


INT_GROUP_BITS = (2, 3, 4, 8)
INT_SCALE_DTYPES = ("fp32", "bf16", "fp16")


def int_group_format(
    bits: int, group_size: int, *, zero_point: str = "none", scale_dtype: str = "fp32"
) -> QuantFormat:
    """Group-wise integers: ``bits``-bit codes, one scale (and zero) per ``group_size`` along K."""
    if bits not in INT_GROUP_BITS:
        raise ValueError(f"integer group formats support bits {INT_GROUP_BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size}")
    if zero_point not in ("none", "int", "float"):
        raise ValueError(
            f"zero_point must be 'none' (symmetric), 'int' (W = (q - z) * s) or 'float' "
            f"(a float shift or zero point: optimum-quanto, torchao int4), got {zero_point!r}"
        )
    if scale_dtype not in INT_SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {INT_SCALE_DTYPES}, got {scale_dtype!r}")
    per = f"per {group_size} along K"
    description = {
        "none": f"INT{bits} symmetric, one {scale_dtype} scale {per}",
        "int": f"INT{bits} asymmetric, one {scale_dtype} scale {per}",
        "float": f"INT{bits} codes with a float shift, W = s * q - shift computed in "
        f"{scale_dtype}, one {scale_dtype} scale and shift {per}",
    }[zero_point]
    return QuantFormat(
        name=f"int{bits}",
        element=f"int{bits}",
        bits=bits,
        block=(1, int(group_size)),
        scale_dtype=scale_dtype,
        zero_point=zero_point,
        description=description,
    )
