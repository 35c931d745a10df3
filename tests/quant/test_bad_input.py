"""Inconsistent payloads and bad quantizer input raise errors that name the problem and the fix."""

import inspect
import re

import pytest
import torch

from qlens.quant.codecs.fp8 import pack_fp8_block
from qlens.quant.codecs.intgroup import pack_int_group
from qlens.quant.codecs.mx import mxfp4_from_gpt_oss, pack_mx
from qlens.quant.codecs.nvfp4 import pack_nvfp4
from qlens.quant.codecs.registry import dequantizer_for
from qlens.quant.dequantize import dequantize
from qlens.quant.formats import fp8_block_format, int_group_format, nvfp4_format
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight


def _raises(match: str):
    return pytest.raises(ValueError, match=re.escape(match))


@pytest.fixture
def fp8():
    return quantize_weight(torch.randn(200, 300), "fp8-block")


def test_scales_inconsistent_with_the_data(fp8):
    with _raises("fp8_block payload `scales` must have shape [2, 3], got [2, 2]"):
        pack_fp8_block(fp8.data, fp8.scales[:, :2])
    mx = quantize_weight(torch.randn(4, 64), "mxfp4")
    with _raises("mxfp4 payload `scales` must have shape [4, 2], got [4, 1]"):
        pack_mx(mx.data, mx.scales[:, :1].contiguous(), (4, 64))
    with _raises("mxfp4 payload `data` must have shape [4, 48], got [4, 32]; MXFP4 packs two"):
        pack_mx(mx.data, mx.scales, (4, 96))
    nv = quantize_weight(torch.randn(4, 32), "nvfp4")
    with _raises("nvfp4 payload `scales` must have shape [32, 16], got [4, 2]"):
        pack_nvfp4(nv.data, nv.scales, nv.global_scale, (4, 32), layout={"scale_swizzle": "32_4_4"})
    with _raises("int4 payload `scales` must have shape [2, 3], got [2, 2]"):
        pack_int_group(
            torch.zeros(2, 40, dtype=torch.long), torch.ones(2, 2), bits=4, group_size=16
        )


def test_wrong_dtypes(fp8):
    with _raises("fp8_block payload `data` must be torch.float8_e4m3fn, got torch.float32"):
        pack_fp8_block(fp8.data.float(), fp8.scales)
    with _raises("fp8_block payload `scales` must be torch.float32, got torch.bfloat16"):
        pack_fp8_block(fp8.data, fp8.scales.bfloat16())
    nv = quantize_weight(torch.randn(4, 32), "nvfp4")
    with _raises("nvfp4 payload `scales` must be torch.float8_e4m3fn, got torch.float32"):
        pack_nvfp4(nv.data, nv.scales.float(), nv.global_scale, (4, 32))
    with _raises("nvfp4 payload `global_scale` must be torch.float32, got torch.float16"):
        pack_nvfp4(nv.data, nv.scales, nv.global_scale.half(), (4, 32))
    with _raises(
        "mxfp4 payload `scales` must be torch.uint8 or torch.float8_e8m0fnu, got torch.float32"
    ):
        pack_mx(torch.zeros(1, 16, dtype=torch.uint8), torch.ones(1, 1), (1, 32))
    with _raises(
        "`scales` must be torch.float32 or torch.bfloat16 or torch.float16, got torch.int32"
    ):
        pack_int_group(
            torch.zeros(1, 8, dtype=torch.long),
            torch.ones(1, 1, dtype=torch.int32),
            bits=4,
            group_size=8,
        )


def test_e8m0_nan_scales_are_refused():
    scales = torch.tensor([[127, 255]], dtype=torch.uint8)
    with _raises("mxfp8 payload `scales` holds 1 E8M0 NaN bytes (255), first at index [0, 1]"):
        pack_mx(torch.zeros(1, 64).to(torch.float8_e4m3fn), scales, (1, 64))
    with _raises("fp8_block payload `scales` holds 1 E8M0 NaN bytes (255)"):
        pack_fp8_block(torch.zeros(1, 200).to(torch.float8_e4m3fn), scales)
    with _raises("holds 2 E8M0 NaN bytes"):
        mxfp4_from_gpt_oss(
            torch.zeros(1, 1, 2, 16, dtype=torch.uint8),
            torch.full((1, 1, 2), 255, dtype=torch.uint8),
        )


def test_nan_and_infinite_scales_are_refused(fp8):
    bad = fp8.scales.clone()
    bad[1, 2] = float("inf")
    with _raises(
        "fp8_block payload `scales` must be finite, but 1 entries are NaN or infinite (first at index [1, 2]: inf)"
    ):
        pack_fp8_block(fp8.data, bad)
    nv = quantize_weight(torch.randn(4, 32), "nvfp4")
    nan_scales = nv.scales.clone()
    nan_scales.view(torch.uint8)[0, 0] = 0x7F  # E4M3 NaN
    with _raises("nvfp4 payload `scales` must be finite"):
        pack_nvfp4(nv.data, nan_scales, nv.global_scale, (4, 32))
    with _raises("nvfp4 payload `global_scale` must be finite"):
        pack_nvfp4(nv.data, nv.scales, torch.tensor(float("nan")), (4, 32))
    with _raises("`global_scale` is 0 under the 'divide' convention"):
        pack_nvfp4(nv.data, nv.scales, torch.tensor(0.0), (4, 32), global_convention="divide")


def test_non_contiguous_packed_data_is_refused():
    mx = quantize_weight(torch.randn(32, 64), "mxfp4")
    strided = torch.zeros(32, 32, dtype=torch.uint8).T
    with _raises("mxfp4 payload `data` must be contiguous (packed data is addressed by offset)"):
        pack_mx(strided, mx.scales, (32, 64))


def test_device_mismatch_names_both_devices(fp8):
    moved = QuantPayload(fp8.format, fp8.data, fp8.shape, scales=fp8.scales.to("meta"))
    with _raises(
        "fp8_block payload `scales` is on meta but `data` is on cpu; move the whole payload with payload.to(device)"
    ):
        dequantize(moved)


def test_inconsistent_formats_and_layouts():
    p = quantize_weight(torch.randn(2, 16), "int4", group_size=8)
    no_zeros = QuantPayload(
        int_group_format(4, 8, zero_point="int"), p.data, p.shape, scales=p.scales
    )
    with _raises("has zero_point='int' but `zeros` is missing"):
        dequantize(no_zeros)
    unknown = QuantPayload(p.format, p.data, p.shape, scales=p.scales, layout={"packing": "exl2"})
    with _raises(
        "unknown layout['packing']='exl2'; known: ['qlens', 'gptq', 'awq', 'compressed-tensors']"
    ):
        dequantize(unknown)
    mx = quantize_weight(torch.randn(2, 32), "mxfp4")
    mx.layout["scale_swizzle"] = "128x4"
    with _raises("layout['scale_swizzle'] must be one of ['none', '32_4_4'], got '128x4'"):
        dequantize(mx)
    with _raises("zero points must fit torch.uint8"):
        pack_int_group(
            torch.zeros(1, 8, dtype=torch.long),
            torch.ones(1, 1),
            torch.full((1, 1), 300),
            bits=4,
            group_size=8,
        )
    with _raises("`codes` must be unsigned 4-bit values in [0, 16), got range [0, 16]"):
        pack_int_group(torch.tensor([[0, 16]]), torch.ones(1, 1), bits=4, group_size=8)
    with pytest.raises(ValueError, match="global_scale must be 'multiply'"):
        nvfp4_format("reciprocal")
    with pytest.raises(ValueError, match="fp8_block scale_dtype must be 'fp32' or 'e8m0'"):
        fp8_block_format(scale_dtype="fp16")


def test_registry_names_the_known_formats():
    with pytest.raises(
        ValueError, match=r"no dequantizer for format 'fp6'; known formats: .*fp8_block.*nvfp4"
    ):
        dequantizer_for("fp6")


@pytest.mark.parametrize(
    ("weight", "scheme", "options", "message"),
    [
        (
            torch.zeros(4, 4, dtype=torch.int8),
            "int4",
            {},
            "needs a float16/bfloat16/float32/float64 tensor, got torch.int8",
        ),
        (
            torch.zeros(8),
            "int4",
            {},
            "needs a [out, in] or [experts, out, in] weight, got shape [8]",
        ),
        (torch.tensor([[1.0, float("nan")]]), "mxfp4", {}, "got NaN or infinite weights"),
        (torch.zeros(2, 2), "int4", {"group_size": 0}, "group_size must be a positive int, got 0"),
        (
            torch.zeros(2, 2),
            "mxfp4",
            {"group_size": 16},
            "mxfp4 uses a fixed group of 32, got group_size=16",
        ),
        (torch.zeros(2, 2), "nvfp4", {"block_size": 16}, "block_size applies to 'fp8-block' only"),
        (
            torch.zeros(2, 2),
            "fp8-block",
            {"group_size": 128},
            "fp8-block takes block_size=(rows, cols), not group_size",
        ),
        (
            torch.zeros(2, 2),
            "fp8-block",
            {"scale_dtype": "bf16"},
            "fp8-block scale_dtype must be 'fp32' or 'e8m0', got 'bf16'",
        ),
        (
            torch.zeros(2, 2),
            "int8",
            {"scale_dtype": "e8m0"},
            "integer scale_dtype must be one of ['fp32', 'bf16', 'fp16'], got 'e8m0'",
        ),
        (
            torch.zeros(2, 2),
            "mxfp8",
            {"asymmetric": True},
            "asymmetric=True applies to int4/int8 only",
        ),
        (
            torch.zeros(2, 2),
            "nvfp4",
            {"scale_dtype": "e8m0"},
            "nvfp4 scales are e4m3, got scale_dtype='e8m0'",
        ),
    ],
)
def test_quantizer_rejects_bad_input(weight, scheme, options, message):
    # unwrapped: callers without the test-time shape checker get the quantizer's own message
    with _raises(message):
        inspect.unwrap(quantize_weight)(weight, scheme, **options)


def test_dequantize_rejects_what_it_cannot_read():
    with pytest.raises(
        TypeError, match="qlens cannot dequantize a builtins.str: expected a QuantPayload"
    ):
        dequantize("weights.safetensors")
    p = quantize_weight(torch.randn(2, 32), "int8")
    with _raises("dequantize dtype must be a floating torch.dtype, got torch.int8"):
        dequantize(p, torch.int8)
