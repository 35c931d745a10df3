"""torchao's int4 weight tensors (``Int4WeightOnlyConfig``) adopted packed, on the CPU.

torchao creates ``Int4Tensor`` with mslk's CUDA quantizer and ``Int4PlainInt32Tensor`` on XPU/NPU
only, and has no ``dequantize()`` for either; their forwards run mslk's CUDA kernels or XPU/NPU
ones. So each tensor is built here through its own constructor from hand-made codes in its
documented layout (signed nibbles low first, ``scale``/``zero_point`` as ``[K/g, N]``; unsigned
nibbles, four bytes to an int32, int8 zero points), and the oracle is torchao's own dequantize
primitive for the format's arithmetic applied to those codes: ``_dequantize_affine_tinygemm``
(float zero point, ``(u - 8) * s + z`` with ``u = q + 8``) and ``dequantize_affine`` (integer
zero point, ``(u - z) * s``), both to float32. ``Int4TilePackedTo4dTensor`` (tinygemm tiles) is
read on CUDA only: tests/quant/adopt/test_adopt_torchao_int4_gpu.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

torchao_quantization = pytest.importorskip("torchao.quantization")
primitives = pytest.importorskip("torchao.quantization.quant_primitives")

import qlens  # noqa: E402
from qlens.kernels.weights import unsupported_reason  # noqa: E402
from qlens.modules.convert import to_quant_linears  # noqa: E402
from qlens.quant.adopt import adopt_module, is_quantized_module  # noqa: E402
from qlens.quant.codecs.element_scales import element_scales  # noqa: E402
from qlens.quant.codecs.int4_float_zero import pack_int4_float_zero  # noqa: E402
from qlens.quant.codecs.intgroup import repack_to_qlens, unpack_int  # noqa: E402
from qlens.quant.dequantize import dequantize  # noqa: E402
from qlens.quant.payload import QuantPayload  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402
from qlens.weights import W_Q  # noqa: E402

Int4Tensor = torchao_quantization.Int4Tensor
Int4PlainInt32Tensor = torchao_quantization.Int4PlainInt32Tensor
Int4PreshuffledTensor = torchao_quantization.Int4PreshuffledTensor
Int4TilePackedTo4dTensor = torchao_quantization.Int4TilePackedTo4dTensor


def _scales(gen: torch.Generator, groups: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).to(dtype)


def plain_int4(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    """An ``Int4Tensor`` and its unsigned codes ``u = q + 8`` ``[N, K]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    qdata = (q[:, ::2] & 0xF) | (q[:, 1::2] << 4)  # mslk's pack_int4: low nibble = even k
    scale = _scales(gen, k // group, n, dtype)
    zero = (torch.randn(k // group, n, generator=gen) * 0.02).to(dtype)
    weight = Int4Tensor(qdata.contiguous(), scale, zero, [1, group], torch.Size([n, k]))
    return weight, q.int() + 8


def plain_int4_oracle(weight, codes: torch.Tensor) -> torch.Tensor:
    return primitives._dequantize_affine_tinygemm(
        codes, (1, weight.block_size[1]), weight.scale.t().contiguous(),
        weight.zero_point.t().contiguous(), torch.int32, 0, 15, output_dtype=torch.float32,
    )  # fmt: skip


def plain_int32(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0, zeros=None):
    """An XPU-layout ``Int4PlainInt32Tensor`` and its unsigned codes ``[N, K]``."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = (u[:, 1::2] << 4 | u[:, ::2]).to(torch.uint8).contiguous()  # as torchao's XPU path
    if zeros is None:
        zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int8)
    weight = Int4PlainInt32Tensor(
        packed.view(torch.int32), _scales(gen, k // group, n, dtype), zeros, [1, group],
        torch.Size([n, k]),
    )  # fmt: skip
    return weight, u


def plain_int32_oracle(weight, codes: torch.Tensor) -> torch.Tensor:
    return primitives.dequantize_affine(
        codes, (1, weight.block_size[1]), weight.scale.t().contiguous(),
        weight.zero_point.t().contiguous(), torch.int32, 0, 15, output_dtype=torch.float32,
    )  # fmt: skip


def _holding(weight) -> nn.Linear:
    n, k = weight.shape
    module = nn.Linear(k, n, bias=False)
    module.weight = nn.Parameter(weight, requires_grad=False)  # as torchao's quantize_ does
    return module


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), groups=st.integers(1, 4),
       group=st.sampled_from([32, 64, 128]))  # fmt: skip
def test_int4_tensor_is_adopted_exactly(dtype, seed, n, groups, group):
    weight, codes = plain_int4(n, group * groups, group, dtype, seed)
    module = _holding(weight)
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == "int4" and payload.format.zero_point == "float"
    assert payload.format.block == (1, group) and payload.shape == (n, group * groups)
    assert payload.layout["packing"] == "torchao"
    assert payload.data.data_ptr() == weight.qdata.data_ptr()  # the packed codes are shared
    expected = plain_int4_oracle(weight, codes)
    assert torch.equal(dequantize(payload), expected)
    assert torch.equal(dequantize(module, dtype), expected.to(dtype))
    assert "packing is 'torchao'" in (unsupported_reason(payload) or "")  # no fused kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), groups=st.integers(1, 4),
       group=st.sampled_from([32, 64, 128]))  # fmt: skip
def test_plain_int32_is_the_qlens_int4_layout(dtype, seed, n, groups, group):
    weight, codes = plain_int32(n, group * groups, group, dtype, seed)
    payload = adopt_module(_holding(weight))
    assert payload.layout["packing"] == "qlens" and payload.format.zero_point == "int"
    assert payload.data.data_ptr() == weight.qdata.data_ptr()  # the int32 words, as bytes
    assert torch.equal(dequantize(payload), plain_int32_oracle(weight, codes))
    assert unsupported_reason(payload) is None  # qlens' fused int4 kernels read it as it is


def test_plain_int32_with_midpoint_zeros_is_symmetric():
    zeros = torch.full((2, 16), 8, dtype=torch.int8)
    weight, codes = plain_int32(16, 64, 32, torch.bfloat16, zeros=zeros)
    payload = adopt_module(_holding(weight))
    assert payload.format.zero_point == "none" and payload.zeros is None
    assert torch.equal(dequantize(payload), plain_int32_oracle(weight, codes))


def test_int4_tensor_for_fp8_activations_is_read_as_the_same_weight():
    # activation_dtype=float8 (symmetric codes, zero points 0) changes torchao's matmul, not W
    weight, codes = plain_int4(16, 64, 32, torch.bfloat16)
    weight.zero_point.zero_()
    fp8 = Int4Tensor(
        weight.qdata, weight.scale, weight.zero_point, [1, 32], torch.Size([16, 64]),
        activation_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    assert torch.equal(dequantize(_holding(fp8)), plain_int4_oracle(weight, codes))


def test_unreadable_int4_tensors_are_refused_with_the_reason():
    bf16 = torch.bfloat16
    weight, _ = plain_int4(16, 64, 32, bf16)
    preshuffled = Int4PreshuffledTensor(
        weight.qdata, weight.scale, [1, 32], torch.Size([16, 64]), group_zero=weight.zero_point
    )
    npu, _ = plain_int32(16, 64, 32, bf16, zeros=torch.zeros(2, 16, dtype=bf16))
    tiles = Int4TilePackedTo4dTensor(
        torch.zeros(2, 1, 32, 4, dtype=torch.int32), torch.zeros(8, 16, 2, dtype=bf16), [1, 128],
        torch.Size([16, 64]),
    )  # fmt: skip
    pre_scaled, _ = plain_int4(16, 64, 32, bf16)
    pre_scaled.act_pre_scale = torch.ones(64, dtype=bf16)
    experts = Int4Tensor(
        weight.qdata.reshape(2, 8, 32), weight.scale.reshape(2, 2, 8),
        weight.zero_point.reshape(2, 2, 8), [1, 1, 32], torch.Size([2, 8, 64]),
    )  # fmt: skip
    cases = [
        (preshuffled, r"Int4PreshuffledTensor holds mslk's preshuffled int4 bytes"),
        (npu, r"Int4PlainInt32Tensor with torch.bfloat16 zero points is the Ascend NPU layout"),
        (tiles, r"Int4TilePackedTo4dTensor holds tinygemm's CUDA tensor-core tiles.*on cpu"),
        (pre_scaled, r"Int4Tensor with an act_pre_scale .* is not adopted"),
        (experts, r"Int4Tensor of shape \[2, 8, 64\] is not adopted"),
    ]
    for weight, message in cases:
        module = nn.Module()
        module.weight = nn.Parameter(weight, requires_grad=False)
        assert is_quantized_module(module)
        with pytest.raises(NotImplementedError, match=message) as error:
            adopt_module(module)
        assert "IntxWeightOnlyConfig(weight_dtype=torch.int4" in str(error.value)
        assert "Int4WeightOnlyConfig(int4_packing_format='plain')" in str(error.value)


@pytest.fixture(scope="module", params=["Int4Tensor", "Int4PlainInt32Tensor"])
def int4_llama(request):
    """A float32 Llama whose decoder linears hold hand-made torchao int4 weights (bf16 scales),
    with the float twin holding the oracle's dequantized weights."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    twin = copy.deepcopy(model)
    make, oracle = {
        "Int4Tensor": (plain_int4, plain_int4_oracle),
        "Int4PlainInt32Tensor": (plain_int32, plain_int32_oracle),
    }[request.param]
    for seed, (name, module) in enumerate(list(model.model.named_modules())):
        if isinstance(module, nn.Linear):
            n, k = module.weight.shape
            weight, codes = make(n, k, 32, torch.bfloat16, seed)
            module.weight = nn.Parameter(weight, requires_grad=False)
            twin.model.get_submodule(name).weight.data = oracle(weight, codes)
    return model, twin


def test_bridge_guard_and_audit(int4_llama):
    model, twin = int4_llama
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = twin(ids).logits
        bridge = qlens.load(model)
        # torchao's own forward cannot run on the CPU: qlens runs the exact dequantized weight
        assert len(bridge.rerouted) == 7
        assert torch.equal(bridge(ids), expected)
    q_proj = model.model.layers[0].self_attn.q_proj
    w_twin = twin.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(dequantize(q_proj), w_twin)  # unchanged by the forward
    with pytest.raises(NotImplementedError, match=r"quantized tensor subclass torchao\."):
        W_Q(bridge, 0)
    with bridge.dequantized():
        w_q = W_Q(bridge, 0)
    # [out, in] rows are head-major: W_Q[h, :, d] = W[h * d_head + d, :]
    assert torch.equal(w_q, w_twin.reshape(4, 16, 64).transpose(1, 2))
    rows = {row.name: row for row in audit_weights(model).rows}
    row = rows["model.layers.0.self_attn.q_proj.weight"]
    assert row.format == "int4" and not row.readable and row.shape == [64, 64]
    zeros = 64 * 2 * 2 if type(q_proj.weight).__name__ == "Int4Tensor" else 64 * 2  # bf16 / uint8
    assert row.bytes == 64 * 64 // 2 + 64 * 2 * 2 + zeros  # nibbles, bf16 scales per 32, zeros


def test_float_zero_codec_checks_what_it_is_given():
    codes = torch.arange(40).reshape(2, 20) % 16  # K = 20: a ragged last group of 4
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    zeros = torch.tensor([[0.25, -1.0], [0.0, 3.0]])
    payload = pack_int4_float_zero(codes, scales, zeros, group_size=16, source="hand-made")
    group_of = torch.arange(20) // 16
    expected = (codes - 8).float() * scales[:, group_of] + zeros[:, group_of]
    assert torch.equal(dequantize(payload), expected)
    assert torch.equal(element_scales(payload), scales[:, group_of])
    with pytest.raises(
        ValueError, match=r"unsigned 4-bit values in \[0, 16\), got range \[1, 16\]"
    ):
        pack_int4_float_zero(codes + 1, scales, zeros, group_size=16, source="x")
    with pytest.raises(ValueError, match=r"`zeros` must be torch.float32, got torch.bfloat16"):
        pack_int4_float_zero(codes, scales, zeros.bfloat16(), group_size=16, source="x")
    with pytest.raises(ValueError, match=r"`scales` must have shape \[2, 2\], got \[2, 1\]"):
        pack_int4_float_zero(codes, scales[:, :1], zeros[:, :1], group_size=16, source="x")
    fields = {n: getattr(payload, n) for n in ("format", "data", "shape", "scales", "layout")}
    with pytest.raises(ValueError, match=r"`zeros` is missing \(None\)"):
        dequantize(QuantPayload(**fields))
    with pytest.raises(ValueError, match="float shift or zero point .* dequantize it instead"):
        repack_to_qlens(payload)
    with pytest.raises(ValueError, match="zero_point='float'; its codes have no integer zero"):
        unpack_int(payload)


def test_save_quantized_round_trip(int4_llama, tmp_path):
    model, twin = int4_llama
    model = copy.deepcopy(model)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = twin(ids).logits
        assert len(to_quant_linears(model)) == 7
        assert torch.equal(model(ids).logits, expected)
        qlens.save_quantized(model, tmp_path / "saved")
        reloaded = qlens.load_quantized(tmp_path / "saved")
        assert torch.equal(reloaded(ids).logits, expected)
