"""GGUF block decoding against gguf-py (``gguf.quants``), bit-exact in float32."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from qlens.quant.adopt.higgs_gguf import gguf_payload  # noqa: E402
from qlens.quant.codecs.gguf import (  # noqa: E402
    GGML_TYPES,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    dequantize_gguf,
    gguf_format,
    row_bytes,
)
from qlens.quant.expert_payloads import select_expert  # noqa: E402
from qlens.quant.payload import QuantPayload  # noqa: E402


def _payload(data: torch.Tensor, ggml_type, shape, **extras) -> QuantPayload:
    return QuantPayload(
        gguf_format(ggml_type),
        data,
        tuple(shape),
        layout={"packing": "gguf", "ggml_type": ggml_type.type_id},
        extras=extras,
    )


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_by_gguf_py_matches(ggml_type, dtype):
    rng = np.random.default_rng(ggml_type.type_id)
    weight = (rng.standard_normal((6, 96)) * 0.05).astype(np.float32)
    qtype = gguf.GGMLQuantizationType(ggml_type.type_id)
    packed = gguf.quants.quantize(weight, qtype)
    assert packed.shape == (6, row_bytes(ggml_type, 96))
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    got = dequantize_gguf(_payload(torch.from_numpy(packed), ggml_type, (6, 96)), dtype)
    assert torch.equal(got, expected.to(dtype))


def _random_blocks(ggml_type, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random raw blocks whose float16 scales are finite (gguf-py has no K-quant quantizer)."""
    rng = np.random.default_rng(seed)
    n_blocks = rows * cols // ggml_type.block_size
    blocks = rng.integers(0, 256, (n_blocks, ggml_type.type_size), dtype=np.uint8)
    fp16_offsets = {Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}[
        ggml_type
    ]
    for offset in fp16_offsets:
        scale = rng.uniform(-0.01, 0.01, n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K], ids=lambda t: t.name)
def test_k_quants_match_gguf_py(ggml_type):
    packed = _random_blocks(ggml_type, 3, 512, ggml_type.type_id)
    qtype = gguf.GGMLQuantizationType(ggml_type.type_id)
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    got = dequantize_gguf(_payload(torch.from_numpy(packed), ggml_type, (3, 512)), torch.float32)
    assert torch.equal(got, expected)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    blocks_per_row=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
    exponent_range=st.sampled_from([(0, 256), (0, 4), (100, 160), (250, 256)]),
)
def test_mxfp4_matches_gguf_py_on_every_byte_pattern(rows, blocks_per_row, seed, exponent_range):
    """Random raw blocks, exponents included (denormal scales for e < 2, huge ones near 255)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (rows * blocks_per_row, MXFP4.type_size), dtype=np.uint8)
    packed[:, 0] = rng.integers(*exponent_range, rows * blocks_per_row, dtype=np.uint8)
    packed = packed.reshape(rows, -1)
    qtype = gguf.GGMLQuantizationType.MXFP4
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    shape = (rows, 32 * blocks_per_row)
    got = dequantize_gguf(_payload(torch.from_numpy(packed), MXFP4, shape), torch.float32)
    assert torch.equal(got, expected)


def test_mxfp4_quantized_by_gguf_py_matches():
    weight = (np.random.default_rng(3).standard_normal((5, 128)) * 0.05).astype(np.float32)
    qtype = gguf.GGMLQuantizationType.MXFP4
    packed = gguf.quants.quantize(weight, qtype)
    assert packed.shape == (5, row_bytes(MXFP4, 128)) == (5, 4 * 17)
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_gguf(_payload(torch.from_numpy(packed), MXFP4, (5, 128)), dtype)
        assert torch.equal(got, expected.to(dtype))
    assert gguf_format(MXFP4).scale_dtype == "e8m0" and gguf_format(MXFP4).bits == 4


def test_expert_stack_and_input_permutation():
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((2, 4, 64))).astype(np.float32)
    packed = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    plain = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0))
    got = dequantize_gguf(_payload(torch.from_numpy(packed), Q8_0, (2, 4, 64)), torch.float32)
    assert torch.equal(got, plain)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    permuted = dequantize_gguf(
        _payload(torch.from_numpy(packed[0]), Q8_0, (4, 64), input_permutation=perm),
        torch.float32,
    )
    # GgufLinear computes x[:, perm] @ W_blocks.T, i.e. W[:, perm[j]] = W_blocks[:, j].
    x = torch.randn(3, 64)
    assert torch.equal(permuted[:, perm], plain[0])
    torch.testing.assert_close(x @ permuted.T, x[:, perm] @ plain[0].T)


@settings(max_examples=25, deadline=None)
@given(
    ggml_type=st.sampled_from(list(GGML_TYPES.values())),
    experts=st.integers(1, 3),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_each_expert_of_stacked_blocks_decodes_like_gguf_py(ggml_type, experts, rows, seed):
    """``[experts, rows, row_bytes]`` blocks (a GGUF ``ffn_*_exps`` tensor): the stacked payload
    and each expert's view (``select_expert``) decode to gguf-py's values of that expert."""
    cols = 2 * ggml_type.block_size
    qtype = gguf.GGMLQuantizationType(ggml_type.type_id)
    if ggml_type.block_size == 256:  # K-quants: gguf-py has no quantizer
        packed = _random_blocks(ggml_type, experts * rows, cols, seed).reshape(experts, rows, -1)
    else:
        weight = np.random.default_rng(seed).standard_normal((experts, rows, cols)) * 0.05
        packed = gguf.quants.quantize(weight.astype(np.float32), qtype)
    payload = gguf_payload(torch.from_numpy(packed), ggml_type.type_id)
    assert tuple(payload.shape) == (experts, rows, cols)
    stacked = dequantize_gguf(payload, torch.float32)
    for expert in range(experts):
        expected = torch.from_numpy(gguf.quants.dequantize(packed[expert], qtype))
        assert torch.equal(stacked[expert], expected)
        assert torch.equal(dequantize_gguf(select_expert(payload, expert), torch.float32), expected)


def test_rejects_bad_payloads():
    data = torch.zeros(2, Q4_0.type_size * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"`data` must have shape \[2, 18\]"):
        dequantize_gguf(_payload(data, Q4_0, (2, 32)), torch.float32)
    with pytest.raises(ValueError, match="multiples of 32 weights, got 40"):
        dequantize_gguf(_payload(data, Q4_0, (2, 40)), torch.float32)
    with pytest.raises(ValueError, match="layout\\['ggml_type'\\] says 3"):
        bad = _payload(data, Q4_0, (2, 64))
        bad.layout["ggml_type"] = Q4_1.type_id
        dequantize_gguf(bad, torch.float32)
    with pytest.raises(ValueError, match="not a permutation"):
        dequantize_gguf(
            _payload(data, Q4_0, (2, 64), input_permutation=torch.zeros(64, dtype=torch.int64)),
            torch.float32,
        )
    assert set(GGML_TYPES) == {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 39}


def test_registered_in_the_dequantizer_registry():
    from qlens.quant.codecs.registry import dequantizer_for

    for ggml_type in GGML_TYPES.values():
        assert dequantizer_for(gguf_format(ggml_type).name) is dequantize_gguf


@pytest.mark.slow
def test_real_smollm2_tensors_match_gguf_py():
    """Q4_1 and Q8_0 blocks of the embedded SmolLM2 GGUF file (real llama.cpp quantization)."""
    from qlens.models import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(str(err))
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    for name, rows in (("blk.0.ffn_gate.weight", None), ("token_embd.weight", 64)):
        tensor = tensors[name]
        blocks = np.asarray(tensor.data[:rows])
        ggml_type = GGML_TYPES[int(tensor.tensor_type)]
        cols = blocks.shape[1] // ggml_type.type_size * ggml_type.block_size
        expected = torch.from_numpy(gguf.quants.dequantize(blocks, tensor.tensor_type))
        got = dequantize_gguf(
            _payload(torch.from_numpy(blocks.copy()), ggml_type, (blocks.shape[0], cols)),
            torch.float32,
        )
        assert torch.equal(got, expected)
