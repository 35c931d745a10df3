"""The weight-space guard: readable tensors pass unchanged, everything else names its reason."""

import enum
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qlens.quant.guards import (
    COMPLEX_REMEDY,
    DEFAULT_REMEDY,
    META_REMEDY,
    NUMPY_REMEDY,
    UNINITIALIZED_REMEDY,
    describe_quantization,
    quantization_method,
    require_readable_weight,
    unreadable_weight_reason,
)


class _PackedWrapper:
    """Stands in for a non-tensor payload wrapper (e.g. triton_kernels' MXFP4 Tensor)."""

    shape = (8, 8)


class _Method(str, enum.Enum):
    GPTQ = "gptq"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_readable_weights_pass_through_as_the_same_object(dtype):
    weight = torch.randn(4, 3).to(dtype)
    assert require_readable_weight(weight, operation="read W_Q") is weight
    param = torch.nn.Parameter(weight)
    assert require_readable_weight(param, operation="read W_Q") is param
    assert unreadable_weight_reason(param) is None


@pytest.mark.parametrize(
    ("weight", "reason"),
    [
        (torch.zeros(4, 4, dtype=torch.int8), "integer dtype torch.int8 and shape [4, 4]"),
        (torch.zeros(8, 1, dtype=torch.uint8), "integer dtype torch.uint8 and shape [8, 1]"),
        (torch.zeros(2, 16, dtype=torch.int32), "integer dtype torch.int32"),
        (torch.zeros(4, 4).to(torch.float8_e4m3fn), "1-byte float dtype torch.float8_e4m3fn"),
        (torch.zeros(4, 4).to(torch.float8_e5m2), "1-byte float dtype torch.float8_e5m2"),
        (_PackedWrapper(), "not a torch.Tensor but a test_guards._PackedWrapper"),
        (None, "the weight is missing (None)"),
    ],
)
def test_unreadable_weights_give_their_reason(weight, reason):
    assert reason in unreadable_weight_reason(weight)
    with pytest.raises(NotImplementedError) as info:
        require_readable_weight(weight, operation="compute W_OV")
    message = str(info.value)
    assert message.startswith("qlens cannot compute W_OV because ")
    assert reason in message
    assert "qlens.dequantize(module)" in message


@pytest.mark.parametrize(
    ("weight", "reason", "remedy"),
    [
        (
            torch.empty(4, 4, device="meta"),
            "the weight is on the meta device: it was never materialized (or was offloaded), "
            "so there are no values to read",
            META_REMEDY,
        ),
        (
            torch.nn.UninitializedParameter(),
            "the weight is an uninitialized lazy parameter (UninitializedParameter): it has no "
            "shape and no values yet",
            UNINITIALIZED_REMEDY,
        ),
        (
            torch.zeros(3, 2, dtype=torch.complex64),
            "the weight has complex dtype torch.complex64: it is not a real floating-point "
            "weight (complex is not a quantized format)",
            COMPLEX_REMEDY,
        ),
        (
            np.zeros((3, 2), dtype=np.float32),
            "the weight is a numpy array (float32, shape [3, 2]), not a torch.Tensor",
            NUMPY_REMEDY,
        ),
    ],
)
def test_problems_other_than_quantization_give_one_cause_and_their_own_remedy(
    weight, reason, remedy
):
    assert unreadable_weight_reason(weight) == reason
    owner = SimpleNamespace(config={"quant_method": "gptq"})
    with pytest.raises(NotImplementedError) as info:
        require_readable_weight(weight, operation="read W_Q", owner=owner)
    assert str(info.value) == f"qlens cannot read W_Q because {reason}. {remedy}"
    assert "quantiz" not in remedy.lower()


def test_lazy_module_weight_is_refused_until_its_first_forward():
    lazy = torch.nn.LazyLinear(3)
    with pytest.raises(NotImplementedError, match="uninitialized lazy parameter"):
        require_readable_weight(lazy.weight, operation="read W_in")
    lazy(torch.zeros(1, 5))
    assert require_readable_weight(lazy.weight, operation="read W_in") is lazy.weight


def test_the_default_remedy_names_routes_that_exist():
    import qlens

    assert "qlens.load(path, dequantize=True)" in DEFAULT_REMEDY
    assert callable(qlens.dequantize) and callable(qlens.dequantized)
    assert "dequantize" in inspect.signature(qlens.load).parameters


def test_torchao_tensor_subclass_is_unreadable_despite_its_float_dtype():
    quantization = pytest.importorskip("torchao.quantization")
    linear = torch.nn.Sequential(torch.nn.Linear(32, 16))
    quantization.quantize_(linear, quantization.Int8WeightOnlyConfig())
    weight = linear[0].weight
    assert weight.dtype == torch.float32  # the trap: it looks like a float tensor
    reason = unreadable_weight_reason(weight)
    assert f"{type(weight).__module__}.Int8Tensor" in reason
    with pytest.raises(NotImplementedError, match=r"\(quantization: Int8Tensor\)"):
        require_readable_weight(weight, operation="fold layer norms")


def test_other_torchao_subclasses_are_unreadable():
    quantization = pytest.importorskip("torchao.quantization")
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    linear = torch.nn.Sequential(torch.nn.Linear(32, 16))
    quantization.quantize_(linear, quantization.Float8WeightOnlyConfig())
    assert "Float8Tensor" in unreadable_weight_reason(linear[0].weight)
    packed = nvfp4.NVFP4Tensor.to_nvfp4(torch.randn(16, 32))
    assert "nvfp4_tensor.NVFP4Tensor" in unreadable_weight_reason(packed)


def test_quanto_tensor_subclass_is_unreadable():
    quanto = pytest.importorskip("optimum.quanto")
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    assert "WeightQBytesTensor" in unreadable_weight_reason(model[0].weight)


def test_bitsandbytes_weights_name_their_class():
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 32, quant_type="nf4").to("cpu")
    with pytest.raises(NotImplementedError) as info:
        require_readable_weight(layer.weight, operation="read W_in")
    assert "integer dtype torch.uint8 and shape [1024, 1]" in str(info.value)
    assert "(quantization: Params4bit)" in str(info.value)
    int8 = bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False).to("cpu")
    assert describe_quantization(None, int8.weight) == "Int8Params"


@pytest.mark.parametrize(
    "config",
    [
        {"quantization_config": {"quant_method": "gptq"}},
        {"quant_method": "gptq"},
        SimpleNamespace(quantization_config=SimpleNamespace(quant_method="gptq")),
        SimpleNamespace(quantization_config=SimpleNamespace(quant_method=_Method.GPTQ)),
        SimpleNamespace(quantization_config={"quant_method": _Method.GPTQ}),
    ],
)
def test_method_resolves_from_dict_object_and_enum_configs(config):
    assert quantization_method(config) == "gptq"
    model = SimpleNamespace(config=config)
    assert describe_quantization(model) == "gptq"
    with pytest.raises(NotImplementedError, match=r"\(quantization: gptq\)\. Dequantize"):
        require_readable_weight(torch.zeros(2, dtype=torch.int32), operation="x", owner=model)


def test_method_from_a_real_transformers_config():
    from transformers import LlamaConfig

    config = LlamaConfig(quantization_config={"quant_method": "fp8"})
    assert quantization_method(config) == "fp8"
    assert quantization_method(LlamaConfig()) is None


def test_method_falls_back_to_a_generic_phrase_and_a_custom_remedy():
    assert quantization_method(None) is None
    assert (
        describe_quantization(torch.nn.Linear(2, 2)) == "unknown quantization or non-float storage"
    )
    with pytest.raises(NotImplementedError) as info:
        require_readable_weight(
            torch.zeros(2, dtype=torch.int8), operation="slice heads", remedy="Try harder."
        )
    assert str(info.value) == (
        "qlens cannot slice heads because the weight has integer dtype torch.int8 and shape [2]: "
        "it holds packed quantization codes, not weight values (quantization: unknown "
        "quantization or non-float storage). Try harder."
    )


def test_unfrozen_quanto_module_is_read_through_the_weight_its_forward_uses():
    quanto = pytest.importorskip("optimum.quanto")
    from qlens.weights.access import read_weight

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quanto.quantize(model, weights=quanto.qint4)  # not frozen: weight is still the float one
    layer = model[0]
    assert type(layer.weight) is torch.nn.Parameter
    with pytest.raises(NotImplementedError, match="quantized tensor subclass optimum.quanto"):
        read_weight(layer, operation="read W_in")
    dequantized = read_weight(layer, operation="read W_in", dequantize=True)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(dequantized, layer.qweight.dequantize())
        assert not torch.equal(dequantized, layer.weight)  # the float weight is not what runs
        torch.testing.assert_close(layer(x), x @ dequantized.T + layer.bias)
