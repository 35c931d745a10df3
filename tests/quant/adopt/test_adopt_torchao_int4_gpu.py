"""torchao int4 weights made on a CUDA GPU by ``quantize_`` itself (skipped without CUDA).

``Int4TilePackedTo4dTensor`` (tinygemm tiles, ``int4_packing_format="tile_packed_to_4d"``) is
read back through tinygemm's own kernel; the oracle recomputes torchao's quantization of the same
padded weight with its own primitives (``_choose_qparams_affine_tinygemm``,
``_quantize_affine_tinygemm``: deterministic, the calls ``from_hp`` makes) and dequantizes the
codes with ``_dequantize_affine_tinygemm`` to float32. ``Int4Tensor`` (the default "plain"
packing) needs mslk, and is checked against mslk's own ``int4_row_quantize_zp`` where mslk is
installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

torchao_quantization = pytest.importorskip("torchao.quantization")
primitives = pytest.importorskip("torchao.quantization.quant_primitives")

import qlens  # noqa: E402
from qlens.quant.adopt import adopt_module  # noqa: E402
from qlens.quant.codecs.int4_float_zero import signed_codes  # noqa: E402
from qlens.quant.dequantize import dequantize  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402
from qlens.weights import W_Q  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
        reason="needs a CUDA GPU of compute capability 8.0 or newer (tinygemm)",
    ),
]


def _quantized(module: nn.Module, group: int, packing: str) -> None:
    config = torchao_quantization.Int4WeightOnlyConfig(
        group_size=group, int4_packing_format=packing
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao_quantization.quantize_(module, config)


def _tinygemm_oracle(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's unsigned codes ``[N, K]`` and float32 dequantization of ``w``, as ``from_hp``
    quantizes it (padded to K % 1024 == 0 and N % 8 == 0, then cut)."""
    n, k = w.shape
    padded = F.pad(w, (0, -k % 1024, 0, -n % 8))
    block = (1, group)
    scale, zero = primitives._choose_qparams_affine_tinygemm(
        padded, primitives.MappingType.ASYMMETRIC, block, torch.int32, 0, 15,
        scale_dtype=w.dtype, zero_point_dtype=w.dtype,
    )  # fmt: skip
    codes = primitives._quantize_affine_tinygemm(
        padded, list(block), scale, zero, torch.int32, 0, 15
    )
    weight = primitives._dequantize_affine_tinygemm(
        codes, block, scale, zero, torch.int32, 0, 15, output_dtype=torch.float32
    )
    return codes[:n, :k], weight[:n, :k]


@pytest.mark.parametrize(("n", "k", "group"), [(100, 320, 64), (64, 2048, 128), (24, 96, 32)])
def test_tile_packed_is_read_back_exactly(n, k, group):
    torch.manual_seed(n + k)
    holder = nn.Sequential(nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda"))
    float_weight = holder[0].weight.detach().clone()
    _quantized(holder, group, "tile_packed_to_4d")
    module = holder[0]
    assert type(module.weight).__name__ == "Int4TilePackedTo4dTensor"
    payload = adopt_module(module)
    assert payload.format.name == "int4" and payload.format.zero_point == "float"
    assert payload.shape == (n, k) and payload.format.block == (1, group)
    codes, expected = _tinygemm_oracle(float_weight, group)
    assert torch.equal(signed_codes(payload).int() + 8, codes)
    assert torch.equal(dequantize(payload), expected)
    assert torch.equal(dequantize(module, torch.bfloat16), expected.bfloat16())
    # and torchao's own forward computes with these weights (bf16 tinygemm: a few ulps apart)
    x = torch.randn(3, k, dtype=torch.bfloat16, device="cuda")
    theirs = module(x).float()
    ours = x.float() @ expected.t()
    assert (ours - theirs).abs().max() <= 2e-2 * ours.abs().max()


def test_tile_packed_llama_bridge_guard_audit_and_reroute():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    _quantized(model.model, 32, "tile_packed_to_4d")
    ids = torch.tensor([[1, 2, 3, 4, 5]], device="cuda")
    with torch.no_grad():
        theirs = model(ids).logits
        bridge = qlens.load(model)
        assert bridge.rerouted == []  # tinygemm runs on CUDA: the library's forward is kept
        # the bridge's attention calls SDPA itself: the same kernels, allowed bf16 rounding
        kept = bridge(ids).float()
        assert (kept - theirs.float()).abs().max() <= 1e-2 * theirs.float().abs().max()
    q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(NotImplementedError, match=r"quantized tensor subclass torchao\."):
        W_Q(bridge, 0)
    with bridge.dequantized():
        w_q = W_Q(bridge, 0)
    weight = dequantize(q_proj, w_q.dtype)
    assert torch.equal(w_q, weight.reshape(4, 16, 64).transpose(1, 2))
    row = {r.name: r for r in audit_weights(model).rows}["model.layers.0.self_attn.q_proj.weight"]
    assert row.format == "int4" and not row.readable and row.shape == [64, 64]
    # qlens' own forward on the exact dequantized weights agrees with tinygemm's to bf16 rounding
    rerouted = qlens.reroute_quantized_modules(model, force=True)
    assert len(rerouted) == 7
    with torch.no_grad():
        ours = model(ids).logits
    assert (ours.float() - theirs.float()).abs().max() <= 5e-2 * theirs.float().abs().max()
    assert torch.equal(dequantize(q_proj, w_q.dtype), weight)  # unchanged by the forwards


def test_plain_int4_tensor_matches_mslk():
    shuffle = pytest.importorskip("mslk.quantize.shuffle")
    torch.manual_seed(1)
    n, k, group = 96, 256, 64
    holder = nn.Sequential(nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda"))
    float_weight = holder[0].weight.detach().clone()
    _quantized(holder, group, "plain")
    module = holder[0]
    assert type(module.weight).__name__ == "Int4Tensor"
    q, scale, zero = shuffle.int4_row_quantize_zp(float_weight, group)  # mslk's own quantizer
    expected = primitives._dequantize_affine_tinygemm(
        q.int() + 8, (1, group), scale.to(torch.bfloat16).t().contiguous(),
        zero.to(torch.bfloat16).t().contiguous(), torch.int32, 0, 15, output_dtype=torch.float32,
    )  # fmt: skip
    payload = adopt_module(module)
    assert torch.equal(signed_codes(payload), q)
    assert torch.equal(dequantize(payload), expected)
    x = torch.randn(3, k, dtype=torch.bfloat16, device="cuda")
    theirs = module(x).float()
    ours = x.float() @ expected.t()
    assert (ours - theirs).abs().max() <= 2e-2 * ours.abs().max()
