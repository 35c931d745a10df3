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
