"""GGUF Q4_0 / Q8_0 repacked into the qlens int layouts: the same weight, bit for bit, and
readable by the kernels; the other GGML types and permuted columns refuse."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from qlens.kernels import quantized_linear, reference_linear, supports  # noqa: E402
from qlens.quant.codecs.gguf import GGML_TYPES, Q4_0, Q8_0, gguf_format, row_bytes  # noqa: E402
from qlens.quant.codecs.intgroup import repack_to_qlens  # noqa: E402
from qlens.quant.dequantize import dequantize  # noqa: E402
from qlens.quant.payload import QuantPayload  # noqa: E402


def _gguf_payload(ggml_type, shape, seed=0, **extras) -> QuantPayload:
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    weight[..., :32] = 0.0  # an all-zero block (d = 0)
    weight[..., 40] = 3.0  # an outlier
    flat = weight.reshape(-1, shape[-1])
    packed = gguf.quants.quantize(flat, gguf.GGMLQuantizationType(ggml_type.type_id))
    data = torch.from_numpy(np.ascontiguousarray(packed)).reshape(*shape[:-1], -1)
    layout = {"packing": "gguf", "ggml_type": ggml_type.type_id}
    return QuantPayload(gguf_format(ggml_type), data, tuple(shape), layout=layout, extras=extras)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(6, 96), (3, 5, 64)], ids=["2d", "experts"])
def test_q4_0_and_q8_0_repack_exactly(ggml_type, shape):
    payload = _gguf_payload(ggml_type, shape)
    repacked = repack_to_qlens(payload)
    assert repacked.format.name == ("int4" if ggml_type is Q4_0 else "int8")
    assert repacked.format.block == (1, 32) and repacked.scales.dtype == torch.float16
    assert torch.equal(dequantize(repacked, torch.float32), dequantize(payload, torch.float32))
    identity = torch.arange(shape[-1])
    same = _gguf_payload(ggml_type, shape, input_permutation=identity)
    assert torch.equal(dequantize(repack_to_qlens(same), torch.float32), dequantize(payload))


@pytest.mark.parametrize("ggml_type", [Q4_0, Q8_0], ids=lambda t: t.name)
def test_repacked_gguf_runs_on_the_kernels(ggml_type):
    payload = _gguf_payload(ggml_type, (40, 128), seed=1)
    assert not supports(payload, "cpu")
    repacked = repack_to_qlens(payload)
    assert supports(repacked, "cpu")  # the Triton interpreter stands in for a GPU here
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    expected = reference_linear(x.double(), payload)
    out = quantized_linear(x, repacked)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-6


@pytest.mark.parametrize(
    "ggml_type", [t for t in GGML_TYPES.values() if t not in (Q4_0, Q8_0)], ids=lambda t: t.name
)
def test_other_ggml_types_refuse(ggml_type):
    cols = ggml_type.block_size * 2
    data = torch.randint(0, 256, (2, row_bytes(ggml_type, cols)), dtype=torch.uint8)
    layout = {"packing": "gguf", "ggml_type": ggml_type.type_id}
    payload = QuantPayload(gguf_format(ggml_type), data, (2, cols), layout=layout)
    with pytest.raises(ValueError, match=f"only GGUF Q4_0 and Q8_0 .* not {ggml_type.name}"):
        repack_to_qlens(payload)


def test_permuted_columns_refuse():
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    payload = _gguf_payload(Q4_0, (2, 64), input_permutation=perm)
    with pytest.raises(ValueError, match="permutes its input columns"):
        repack_to_qlens(payload)
