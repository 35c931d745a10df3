"""The kernels' part of each format lives on its codec: the family codes, launch views and Triton
dequantize kernels are read from there, and a format registered with a kernels part is read by
the kernels without any other table changing."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import pytest
import torch

from qlens.kernels import dequantize_triton, plan, weights
from qlens.kernels.dequant import has_dequantize_kernel
from qlens.kernels.formats import (
    BITNET_FORMATS,
    BNB_FORMATS,
    GGUF_KERNEL_FORMATS,
    KernelSupport,
    attach_kernel_support,
    expert_kernel_formats,
    fused_kernel_formats,
    kernel_support,
)
from qlens.kernels.layout_view import (
    BNB4,
    FP8_BLOCK,
    INT4,
    INT8,
    MXFP4,
    MXFP8,
    NVFP4,
    qlens_layout_view,
)
from qlens.kernels.runtime import interpreting
from qlens.kernels.weights import kernel_weight, unsupported_reason
from qlens.quant.codecs import registry
from qlens.quant.codecs.codec import Codec
from qlens.quant.codecs.intgroup import dequantize_int_group, validate_int_group
from qlens.quant.dequantize import dequantize
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

TOY = "toy_int8_kernels"
META = torch.device("meta")


def test_the_family_codes_are_derived_from_the_codecs():
    qlens_layouts = {"fp8_block": FP8_BLOCK, "mxfp8": MXFP8, "mxfp4": MXFP4, "nvfp4": NVFP4,
                     "int4": INT4, "int8": INT8}  # fmt: skip
    expected = {**qlens_layouts, "bnb_nf4": BNB4, "bnb_fp4": BNB4, "bnb_int8": INT8}
    assert weights.FAMILIES == expected
    assert sorted(set(weights.FAMILIES.values())) == list(range(7))
    assert fused_kernel_formats() == sorted(expected)
    assert expert_kernel_formats() == sorted(qlens_layouts)  # bitsandbytes has no experts
    for name, family in expected.items():
        support = kernel_support(name)
        assert support is not None and support.family == family and support.view is not None
        assert support.dequantize_reads_any_layout == (name in BNB_FORMATS)
        assert support.stacked_experts == (name in qlens_layouts)


def test_the_graph_capture_error_names_the_schemes_read_from_the_codecs():
    from qlens.kernels.experts import host_routing_under_capture, one_launch_schemes

    schemes = one_launch_schemes()
    assert sorted(schemes) == ["fp8-block", "int4", "int8", "mxfp4", "mxfp8", "nvfp4"]
    assert [registry.codec_for(name).scheme for name in expert_kernel_formats()] == schemes
    message = str(host_routing_under_capture("these experts loop"))
    assert message.startswith("these experts loop, which reads the routing on the host")
    assert f"run in one launch ({', '.join(schemes)}; contiguous" in message


def test_every_triton_dequantize_is_on_a_registered_codec():
    library = {*BNB_FORMATS, *GGUF_KERNEL_FORMATS, *BITNET_FORMATS}
    with_kernel = {
        c.name
        for c in registry.codecs()
        if isinstance(c.kernels, KernelSupport) and c.kernels.triton_dequantize is not None
    }
    assert with_kernel == library | set(weights.FAMILIES)
    for name in library - set(BNB_FORMATS):
        support = kernel_support(name)
        assert support is not None and support.view is None and support.family is None
    assert kernel_support("higgs") is None and kernel_support("not_a_format") is None


def test_a_format_without_kernels_is_refused_naming_the_formats_that_have_them():
    payload = _relabel(quantize_weight(torch.randn(4, 64), "int8"), "higgs")
    assert unsupported_reason(payload) == (
        "qlens kernels support the formats ['bnb_fp4', 'bnb_int8', 'bnb_nf4', 'fp8_block', 'int4', "
        "'int8', 'mxfp4', 'mxfp8', 'nvfp4'], not 'higgs'; GGUF Q4_0/Q8_0 map onto them exactly with "
        "qlens.quant.codecs.intgroup.repack_to_qlens, other formats need "
        "qlens.kernels.reference_linear (dequantize, then matmul)"
    )
    assert not has_dequantize_kernel(payload)
    with pytest.raises(ValueError, match="qlens kernels support the formats"):
        dequantize_triton(payload, torch.float32)


def test_kernel_support_is_checked_when_made_and_attached_once():
    with pytest.raises(ValueError, match="takes family and view together"):
        KernelSupport(family=INT8)
    with pytest.raises(ValueError, match="needs a family with its view, a triton_dequantize"):
        KernelSupport()
    with pytest.raises(ValueError, match="format 'int8' already has its kernels part"):
        attach_kernel_support("int8", KernelSupport(triton_dequantize=dequantize_triton))
    with pytest.raises(ValueError, match="no dequantizer for format 'not_a_format'"):
        attach_kernel_support("not_a_format", KernelSupport(triton_dequantize=dequantize_triton))


def _relabel(payload: QuantPayload, name: str) -> QuantPayload:
    return dataclasses.replace(payload, format=dataclasses.replace(payload.format, name=name))


@pytest.fixture
def toy_codec() -> Iterator[Codec]:
    """The qlens int8 layout under another name, without a kernels part yet."""
    codec = registry.register_codec(Codec(TOY, dequantize_int_group, validate=validate_int_group))
    try:
        yield codec
    finally:
        registry.unregister_codec(TOY)


def test_a_registered_format_reaches_the_kernels_only_with_its_kernels_part(toy_codec, monkeypatch):
    monkeypatch.setattr(plan, "kernel_device_problem", lambda device: None)  # meta: a GPU
    int8 = quantize_weight(torch.randn(8, 64), "int8", group_size=32)
    payload = _relabel(int8, TOY)
    assert dequantize(payload).equal(dequantize(int8))
    assert f"not '{TOY}'" in (unsupported_reason(payload) or "")
    assert not has_dequantize_kernel(payload)
    assert TOY not in weights.FAMILIES
    route, reason = plan.choose_route(payload, META)
    assert route == "reference" and f"not '{TOY}'" in (reason or "")

    attach_kernel_support(
        TOY,
        KernelSupport(
            family=INT8,
            view=functools.partial(qlens_layout_view, family=INT8),
            triton_dequantize=kernel_support("int8").triton_dequantize,  # type: ignore[union-attr]
        ),
    )
    fresh = _relabel(int8, TOY)  # the refusal above stays cached on the first payload
    assert unsupported_reason(fresh) is None and has_dequantize_kernel(fresh)
    view = kernel_weight(fresh)
    assert (view.name, view.family, view.group_k) == (TOY, INT8, 32)
    assert weights.FAMILIES[TOY] == INT8 and TOY in fused_kernel_formats()
    assert plan.choose_route(fresh, META) == ("kernel", None)
    if interpreting():
        assert torch.equal(dequantize_triton(fresh, torch.float32), dequantize(int8))
