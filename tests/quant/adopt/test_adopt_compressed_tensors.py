"""Adopting compressed-tensors Linear modules (built and compressed with its own API on CPU)
against compressed-tensors' decompression of the same module."""

import warnings

import pytest
import torch
from torch import nn

ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationStrategy as Strategy  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

from qlens.quant.adopt import adopt_module, is_quantized_module  # noqa: E402
from qlens.quant.codecs.registry import dequantizer_for  # noqa: E402


def _calibrate(module):
    """Weight-only min/max calibration, as llm-compressor would do it."""
    args, w, global_scale = module.quantization_scheme.weights, module.weight.data, None
    if args.strategy == Strategy.TENSOR:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == Strategy.CHANNEL:
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
        grouped = w.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
        if args.strategy == Strategy.TENSOR_GROUP:
            global_scale = generate_gparam(w.amin(), w.amax())
            module.weight_global_scale.data.copy_(global_scale)
    else:
        rows, cols = args.block_structure
        blocks = w.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero = calculate_qparams(low, high, args, global_scale=global_scale)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(
        module.weight_scale.shape
    )
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )


def _compressed_model(preset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128))
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_quant.apply_quantization_config(
            model, ct_quant.QuantizationConfig(config_groups={"g": scheme})
        )
        _calibrate(model[0])
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    return model, compressor


@pytest.mark.parametrize(
    "preset,format_name",
    [
        ("W4A16", "int4"),
        ("W4A16_ASYM", "int4"),
        ("W8A16", "int8"),
        ("W8A8", "int8"),
        ("FP8_BLOCK", "fp8_block"),
        ("FP8_DYNAMIC", "fp8_block"),
        ("NVFP4A16", "nvfp4"),
        ("MXFP4A16", "mxfp4"),
        ("MXFP8A16", "mxfp8"),
    ],
)
def test_adopt_matches_decompression(preset, format_name):
    model, compressor = _compressed_model(preset)
    module = model[0]
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == format_name and payload.shape == (128, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compressor.decompress_model(model)
    expected = module.weight.detach()
    # compressed-tensors decompresses NVFP4/MX weights to bfloat16; both compute in float32 and
    # round once, so the comparison is exact in the decompressed dtype.
    got = dequantizer_for(payload.format.name)(payload, expected.dtype)
    assert torch.equal(got, expected)
    assert not is_quantized_module(module)  # decompressed: a plain float weight now


@pytest.mark.parametrize("preset", ["W4A16", "FP8_BLOCK"])
def test_checkpoint_loaded_by_transformers_before_and_after_first_forward(tmp_path, preset):
    from transformers import LlamaConfig, LlamaForCausalLM

    from qlens.quant.dequantize import dequantize

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )  # every projection is a multiple of the 128 x 128 FP8 block
    model = LlamaForCausalLM(config)
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_quant.apply_quantization_config(
            model, ct_quant.QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"])
        )
        for module in model.modules():
            if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
                _calibrate(module)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        model.save_pretrained(tmp_path)
        compressor.update_config(tmp_path)
        loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    quantized = {name: m for name, m in loaded.named_modules() if is_quantized_module(m)}
    assert len(quantized) == 7  # q, k, v, o, gate, up, down
    adopted = {name: dequantize(adopt_module(m)) for name, m in quantized.items()}
    loaded(torch.tensor([[1, 2, 3]]))  # the first forward decompresses in place
    for name, module in quantized.items():
        assert not is_quantized_module(module)
        assert torch.equal(adopted[name], module.weight.detach())
