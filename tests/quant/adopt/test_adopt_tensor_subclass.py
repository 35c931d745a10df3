"""Adopting torchao and optimum-quanto quantized weights against the libraries' own
``.dequantize()`` (exact: int8/e4m3 times a scale is exact in float32, rounded once; quanto
qint4/qint2 are computed in their scales' dtype, as quanto does)."""

import warnings

import pytest
import torch
from torch import nn

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.registry import dequantizer_for


def _dequantize(payload, dtype):
    return dequantizer_for(payload.format.name)(payload, dtype)


def _linear(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 48)).to(dtype)


@pytest.mark.parametrize("config_name,per_group", [("int8", False), ("int8", True), ("fp8", False)])
def test_torchao_weight_only(config_name, per_group):
    torchao_q = pytest.importorskip("torchao.quantization")
    if config_name == "int8":
        granularity = torchao_q.PerGroup(32) if per_group else torchao_q.PerRow()
        config = torchao_q.Int8WeightOnlyConfig(granularity=granularity)
    else:
        config = torchao_q.Float8WeightOnlyConfig()
    model = _linear(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao_q.quantize_(model, config)
    module = model[0]
    assert is_quantized_module(module)
    payload = adopt_module(module)
    expected = module.weight.dequantize()
    assert payload.format.name == ("int8" if config_name == "int8" else "fp8_block")
    assert torch.equal(_dequantize(payload, torch.float32), expected)


@pytest.mark.parametrize("qtype_name", ["qint8", "qfloat8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quanto_bytes(qtype_name, dtype):
    quanto = pytest.importorskip("optimum.quanto")
    model = _linear(dtype, seed=1)
    quanto.quantize(model, weights=getattr(quanto, qtype_name))
    quanto.freeze(model)
    module = model[0]
    assert is_quantized_module(module)
    payload = adopt_module(module)
    expected = module.weight.dequantize()
    assert expected.dtype == dtype
    assert torch.equal(_dequantize(payload, dtype), expected)


def test_quanto_qint4_is_adopted_with_its_float_shift():
    """Exhaustive cases (qint2, dtypes, groups, TinyGemm) are in tests/quant/test_quanto_bits.py."""
    quanto = pytest.importorskip("optimum.quanto")
    model = _linear(torch.float32, seed=2)
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    assert is_quantized_module(model[0])
    payload = adopt_module(model[0])
    assert payload.format.name == "int4" and payload.format.zero_point == "float"
    assert torch.equal(_dequantize(payload, torch.float32), model[0].weight.dequantize())


def _torchao_configs():
    torchao_q = pytest.importorskip("torchao.quantization")
    mx = pytest.importorskip("torchao.prototype.mx_formats.inference_workflow")
    return torchao_q, {
        # MX needs bf16 weights in torchao; NVFP4 activation quantization needs sm100, so the
        # weight-only NVFP4 config is the one that runs on CPU
        "mxfp4": (torch.bfloat16, lambda: mx.MXDynamicActivationMXWeightConfig(
            activation_dtype=torch.float4_e2m1fn_x2, weight_dtype=torch.float4_e2m1fn_x2)),
        "mxfp8": (torch.bfloat16, lambda: mx.MXDynamicActivationMXWeightConfig(
            activation_dtype=torch.float8_e4m3fn, weight_dtype=torch.float8_e4m3fn)),
        "nvfp4": (torch.float32, lambda: mx.NVFP4WeightOnlyConfig()),
        "int4-asym-group": (torch.float32, lambda: torchao_q.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=torchao_q.PerGroup(32))),
        "int4-sym-group": (torch.bfloat16, lambda: torchao_q.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=torchao_q.PerGroup(32),
            mapping_type=torchao_q.MappingType.SYMMETRIC)),
        "int2-row": (torch.float32, lambda: torchao_q.IntxWeightOnlyConfig(
            weight_dtype=torch.int2, granularity=torchao_q.PerAxis(0))),
    }  # fmt: skip


@pytest.mark.parametrize(
    "name,format_name",
    [
        ("mxfp4", "mxfp4"),
        ("mxfp8", "mxfp8"),
        ("nvfp4", "nvfp4"),
        ("int4-asym-group", "int8"),  # IntxUnpackedToInt8Tensor keeps one code per int8
        ("int4-sym-group", "int8"),
        ("int2-row", "int8"),
    ],
)
def test_torchao_subclasses(name, format_name):
    torchao_q, configs = _torchao_configs()
    dtype, config = configs[name]
    model = _linear(dtype, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao_q.quantize_(model, config())
    module = model[0]
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == format_name and payload.shape == (48, 128)
    if name.startswith("mx"):  # MXTensor dequantizes to a given dtype, bf16 only
        expected = module.weight.dequantize(torch.bfloat16)
    else:
        expected = module.weight.dequantize()
    assert torch.equal(_dequantize(payload, expected.dtype), expected)


@pytest.mark.parametrize("qtype_name", ["qint8", "qint4"])
def test_unfrozen_quanto_serves_the_quantized_weight_its_forward_uses(qtype_name):
    from qlens.weights.access import read_weight

    quanto = pytest.importorskip("optimum.quanto")
    model = _linear(torch.float32, seed=4)
    quanto.quantize(model, weights=getattr(quanto, qtype_name))  # not frozen
    module = model[0]
    assert type(module.weight) is nn.Parameter  # the float weight is still there
    assert is_quantized_module(module)
    expected = module.qweight.dequantize()  # what the forward computes with
    assert not torch.equal(expected, module.weight)
    assert torch.equal(_dequantize(adopt_module(module), torch.float32), expected)
    with pytest.raises(NotImplementedError, match="quantized tensor subclass.*optimum.quanto"):
        read_weight(module, operation="read the weight")
    assert torch.equal(read_weight(module, operation="read", dequantize=True), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_nf4(dtype):
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    torch.manual_seed(5)
    module = nn.Linear(128, 128, dtype=dtype)  # 256 blocks of 64: one scaler block of 256
    module.weight = nn.Parameter(nf4.to_nf4(module.weight.data), requires_grad=False)
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == "nf4_torchao" and payload.bits_per_weight < 4.2
    expected = module.weight.get_original_weight()
    assert expected.dtype == dtype
    assert torch.equal(_dequantize(payload, dtype), expected)
