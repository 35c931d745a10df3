"""Dequantization of compressed-tensors checkpoints equals compressed-tensors' own decompression.

Weights are compressed with the library's compressors from hand-calibrated scales (no model, no
llm-compressor), then decoded by qlens and by ``Compressor.decompress``; results are compared
bit for bit in the dtype the library returns.
"""

import pytest
import torch

from qlens.quant.codecs.fp8 import pack_fp8_block
from qlens.quant.codecs.intgroup import repack_to_qlens
from qlens.quant.codecs.mx import pack_mx
from qlens.quant.codecs.nvfp4 import pack_nvfp4
from qlens.quant.dequantize import dequantize
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors import compressors  # noqa: E402
from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402


def _compress(preset: str, weight: torch.Tensor, compressor, symmetric: bool | None = None):
    """The compressed state dict of ``weight`` under ``preset``, calibrated from min/max."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if symmetric is not None:
        scheme.weights = scheme.weights.model_copy(update={"symmetric": symmetric})
    args = scheme.weights
    global_scale = None
    if args.strategy == QuantizationStrategy.TENSOR:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == QuantizationStrategy.BLOCK:
        rows, cols = args.block_structure
        blocks = weight.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        groups = weight.unflatten(-1, (-1, args.group_size))
        low, high = groups.amin(-1), groups.amax(-1)
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:
            global_scale = generate_gparam(weight.amin(), weight.amax())
    scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale}
    if not args.symmetric:
        state["weight_zero_point"] = zero_point
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    compressed = compressor.compress(state, scheme)
    decompressed = compressor.decompress(dict(compressed), scheme)["weight"]
    return compressed, decompressed


@pytest.fixture
def weight():
    return torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize(
    ("preset", "bits", "symmetric"),
    [
        ("W4A16", 4, True),
        ("W4A16", 4, False),
        ("W8A16", 8, True),
        ("W8A16", 8, False),
        ("W3A16", 3, True),
        ("W2A16", 2, False),
    ],
)
def test_pack_quantized_int(weight, preset, bits, symmetric):
    compressor = compressors.PackedQuantizationCompressor
    state, expected = _compress(preset, weight, compressor, symmetric)
    payload = QuantPayload(
        format=int_group_format(bits, 128, zero_point="none" if symmetric else "int"),
        data=state["weight_packed"],
        shape=tuple(int(s) for s in state["weight_shape"]),
        scales=state["weight_scale"],
        zeros=state.get("weight_zero_point"),
        layout={"packing": "compressed-tensors"},
    )
    assert symmetric == ("weight_zero_point" not in state)
    assert torch.equal(dequantize(payload, expected.dtype), expected)
    if bits not in (4, 8):
        return  # other widths have no qlens layout; they dequantize in their own packing
    qlens = repack_to_qlens(payload)
    assert (qlens.zeros is None) == symmetric
    assert torch.equal(dequantize(qlens, expected.dtype), expected)


@pytest.mark.parametrize(
    ("preset", "block"), [("FP8_BLOCK", (128, 128)), ("FP8_DYNAMIC", (1, 256)), ("FP8", (128, 256))]
)
def test_fp8_block_channel_and_tensor_scales(weight, preset, block):
    # per-channel and per-tensor FP8 are block FP8 with a (1, K) or (N, K) block
    state, expected = _compress(preset, weight, compressors.FloatQuantizationCompressor)
    scales = state["weight_scale"].float().reshape(-(-128 // block[0]), -(-256 // block[1]))
    payload = pack_fp8_block(state["weight"], scales, block=block)
    assert torch.equal(dequantize(payload, expected.dtype), expected)


def test_nvfp4_divide_convention(weight):
    state, expected = _compress("NVFP4A16", weight, compressors.NVFP4PackedCompressor)
    payload = pack_nvfp4(
        state["weight_packed"],
        state["weight_scale"],
        state["weight_global_scale"],
        tuple(weight.shape),
        global_convention="divide",
    )
    assert expected.dtype == torch.bfloat16  # the library decompresses NVFP4 to bf16
    assert torch.equal(dequantize(payload, torch.bfloat16), expected)
    # reading the global as a multiplier instead is far off: the convention matters
    wrong = pack_nvfp4(
        state["weight_packed"], state["weight_scale"], state["weight_global_scale"], (128, 256)
    )
    assert not torch.allclose(dequantize(wrong), expected.float(), rtol=0.5)


def test_mxfp4(weight):
    state, expected = _compress("MXFP4A16", weight, compressors.MXFP4PackedCompressor)
    payload = pack_mx(state["weight_packed"], state["weight_scale"], tuple(weight.shape))
    assert payload.format.name == "mxfp4"
    assert torch.equal(dequantize(payload, expected.dtype), expected)


def test_mxfp8(weight):
    state, expected = _compress("MXFP8A16", weight, compressors.MXFP8QuantizationCompressor)
    payload = pack_mx(state["weight"], state["weight_scale"], tuple(weight.shape))
    assert payload.format.name == "mxfp8"
    assert torch.equal(dequantize(payload, expected.dtype), expected)
