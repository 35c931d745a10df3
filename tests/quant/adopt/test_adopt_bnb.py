"""Adopting bitsandbytes Linear4bit / Linear8bitLt modules (quantized on CPU) against
bitsandbytes' own dequantization of the module's weight."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnb_functional  # noqa: E402

from qlens.quant.adopt import adopt_module, is_quantized_module  # noqa: E402
from qlens.quant.codecs.registry import dequantizer_for  # noqa: E402


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_linear4bit(quant_type, nested):
    torch.manual_seed(0)
    module = bnb.nn.Linear4bit(
        128, 40, bias=False, quant_type=quant_type, compress_statistics=nested,
        compute_dtype=torch.float32,
    )  # fmt: skip
    assert not is_quantized_module(module)  # float until moved to a device
    module = module.to("cpu")
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == f"bnb_{quant_type}" and payload.shape == (40, 128)
    expected = bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
    assert torch.equal(dequantizer_for(payload.format.name)(payload, torch.float32), expected)
    x = torch.randn(3, 128)
    torch.testing.assert_close(module(x), x @ expected.T)


def test_linear8bitlt():
    torch.manual_seed(1)
    module = bnb.nn.Linear8bitLt(64, 24, bias=False, has_fp16_weights=False).to("cpu")
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == "bnb_int8"
    expected = bnb_functional.int8_vectorwise_dequant(module.weight.data, module.weight.SCB)
    assert torch.equal(dequantizer_for("bnb_int8")(payload, torch.float32), expected)


def test_plain_linear_and_unknown_quantized_modules_raise():
    plain = torch.nn.Linear(4, 3)
    assert not is_quantized_module(plain)
    with pytest.raises(ValueError, match="not quantized, so there is nothing to adopt"):
        adopt_module(plain)

    class PackedThing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.int8), False)

    with pytest.raises(ValueError, match="cannot adopt a quantized .*PackedThing.*Supported: "):
        adopt_module(PackedThing())


def test_linear4bit_after_cpu_forward_repacking():
    # On AVX512-BF16 CPUs the first eval forward repacks the weight in place for bitsandbytes'
    # CPU GEMM and rounds absmax to bfloat16; the module then computes with those values.
    torch.manual_seed(3)
    module = bnb.nn.Linear4bit(128, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    module = module.to("cpu").eval()
    state = module.weight.quant_state  # nested absmax: the default compress_statistics=True
    packed0, code = module.weight.data.clone(), state.code.clone()
    absmax0 = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    with torch.no_grad():
        module(torch.randn(2, 128))
    repacked = getattr(module.weight.quant_state, "packing_format_for_cpu", False)
    if repacked:
        absmax0 = absmax0.to(torch.bfloat16).float()
    reference = bnb_functional.QuantState(
        absmax=absmax0, shape=torch.Size([64, 128]), code=code, blocksize=64,
        quant_type="nf4", dtype=torch.float32,
    )  # fmt: skip
    expected = bnb_functional.dequantize_4bit(packed0, reference)
    payload = adopt_module(module)
    assert payload.layout.get("source") == ("bitsandbytes-cpu-gemm" if repacked else None)
    assert torch.equal(dequantizer_for("bnb_nf4")(payload, torch.float32), expected)


def test_int8_params_alone_are_never_cast_to_floats():
    """``Int8Params`` inherits ``torch.Tensor.dequantize``, which only casts the codes: read on
    its own (without its module's row scales) the weight is refused, not served as codes."""
    from qlens.weights.access import read_tensor

    module = bnb.nn.Linear8bitLt(64, 24, bias=False, has_fp16_weights=False).to("cpu")
    with pytest.raises(NotImplementedError, match="knows no dequantizer for a bitsandbytes"):
        read_tensor(module.weight, operation="read the weight", dequantize=True)
