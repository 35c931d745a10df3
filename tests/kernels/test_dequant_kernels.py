"""GPU dequantize kernels, run in Triton's interpreter: bit-exact with the torch codecs."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import SCHEMES, quantized, scheme_id

from qlens.kernels import dequantize_triton
from qlens.quant.dequantize import dequantize


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_dequantize_triton_is_bit_exact(case):
    payload = quantized(37, 300, case)  # ragged N and K: partial tiles, groups and blocks
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = dequantize_triton(payload, dtype)
        assert out.dtype == dtype
        assert torch.equal(out, dequantize(payload, dtype))


def test_e8m0_special_bytes_decode_exactly():
    # 0 -> 2**-127 (a subnormal, not zero), 240 -> 2**113: bits reinterpreted, never cast.
    payload = quantized(4, 64, ("mxfp8", {}))
    payload.scales = torch.tensor([[0, 1], [127, 240], [200, 126], [128, 3]], dtype=torch.uint8)
    out = dequantize_triton(payload, torch.float32)
    assert torch.equal(out, dequantize(payload, torch.float32))
    assert out[0, 0] == payload.data[0, 0].float() * 2.0**-127


def test_nvfp4_divide_convention_is_bit_exact():
    from qlens.quant.codecs.nvfp4 import pack_nvfp4

    ref_payload = quantized(20, 96, ("nvfp4", {}))
    payload = pack_nvfp4(
        ref_payload.data,
        ref_payload.scales,
        torch.tensor(3.0) / ref_payload.global_scale,
        (20, 96),
        global_convention="divide",
    )
    assert torch.equal(
        dequantize_triton(payload, torch.float32), dequantize(payload, torch.float32)
    )


def test_dequantize_triton_rejects_other_packings_and_dtypes():
    payload = quantized(8, 64, ("int4", {"group_size": 32}))
    with pytest.raises(ValueError, match="outputs"):
        dequantize_triton(payload, torch.int8)
    payload.layout = {"packing": "gptq"}
    with pytest.raises(ValueError, match="repack_to_qlens"):
        dequantize_triton(payload, torch.float32)


@pytest.mark.parametrize("case", SCHEMES[:3], ids=scheme_id)
def test_dequantize_view_writes_rows_of_a_wider_buffer(case):
    """``out=`` takes rows of a wider buffer (stride(0) > K): the decode lands there, bit-exact,
    and the columns past K are left as they were."""
    from qlens.kernels.dequant import dequantize_view
    from qlens.kernels.weights import kernel_weight

    payload = quantized(24, 96, case)
    buffer = torch.full((24, 100), 7.0, dtype=torch.bfloat16)
    out = dequantize_view(kernel_weight(payload), torch.bfloat16, out=buffer[:, :96])
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :96], dequantize(payload, torch.bfloat16))
    assert torch.equal(buffer[:, 96:], torch.full((24, 4), 7.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
def test_plan_on_the_dequantize_path_prepares_its_launch_once(case, monkeypatch):
    """A plan whose launch is ``"dequant"`` (prefill rows on a GPU; forced here) decodes with
    a launch prepared on the first call of each input shape, and a call gives exactly
    ``F.linear`` on the weight the codec decodes, with and without bias."""
    import torch.nn.functional as F

    import qlens.kernels.dequant as dequant_module
    import qlens.kernels.plan as plan_module
    from qlens.kernels.configs import LinearConfig

    monkeypatch.setattr(
        plan_module, "_weight_config", lambda *args: LinearConfig("dequant", 16, 16, 16)
    )
    prepared = []
    real_prepare = dequant_module._DEQUANT.prepare
    monkeypatch.setattr(
        dequant_module._DEQUANT,
        "prepare",
        lambda *args, **kwargs: prepared.append(args[0]) or real_prepare(*args, **kwargs),
    )
    payload = quantized(40, 96, case)
    plan = plan_module.LinearPlan(payload, torch.device("cpu"), route="kernel")
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 5, 96, generator=gen).to(dtype)
        weight = dequantize(payload, dtype)
        for b in (bias, None, bias):
            expected = F.linear(x, weight, None if b is None else b.to(dtype))
            assert torch.equal(plan(x, b), expected)
    assert len(prepared) == 4  # one per (dtype, bias or none), kept for the repeated call
