"""HQQ ``HQQLinear`` (quantized with the hqq package on CPU): adoption bit-exact against
``HQQLinear.dequantize()``, the guard, the audit, the bridge and save/load through QuantLinear."""

import itertools

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

hqq_quantize = pytest.importorskip("hqq.core.quantize")

import qlens  # noqa: E402
from qlens.modules.convert import to_quant_linears  # noqa: E402
from qlens.quant.adopt import adopt_module, is_quantized_module  # noqa: E402
from qlens.quant.dequantize import dequantize  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402
from qlens.weights import W_Q  # noqa: E402


def _hqq_linear(linear, nbits=4, group_size=32, axis=1, compute_dtype=torch.float32, **kw):
    config = hqq_quantize.BaseQuantizeConfig(nbits=nbits, group_size=group_size, axis=axis, **kw)
    return hqq_quantize.HQQLinear(linear, config, compute_dtype=compute_dtype, device="cpu")


CASES = list(
    itertools.product([1, 2, 3, 4, 8], [0, 1], [torch.float32, torch.bfloat16], [False, True])
)


@pytest.mark.parametrize("nbits,axis,compute_dtype,view_as_float", CASES)
def test_dequantize_is_bit_exact(nbits, axis, compute_dtype, view_as_float):
    torch.manual_seed(nbits)
    module = _hqq_linear(
        nn.Linear(64, 48), nbits, 16, axis, compute_dtype, view_as_float=view_as_float
    )
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == "hqq" and payload.shape == (48, 64)
    expected = module.dequantize()
    assert torch.equal(dequantize(payload, expected.dtype), expected)
    # adoption reads without modifying: a second read and HQQ's own agree after a forward
    module(torch.randn(2, 64, dtype=compute_dtype))
    assert torch.equal(dequantize(module, expected.dtype), module.dequantize())


@pytest.fixture(scope="module")
def hqq_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    for name, module in list(model.model.named_modules()):
        if isinstance(module, nn.Linear):
            quantized = _hqq_linear(module)
            # hqq's inference patching gives each HQQLinear a placeholder float weight
            quantized.weight = nn.Parameter(torch.zeros(1), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.model.get_submodule(parent), child, quantized)
    return model


def test_bridge_guard_and_audit(hqq_llama):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = hqq_llama(ids).logits
        bridge = qlens.load(hqq_llama)
        # HQQ's forward runs on CPU and is kept: the logits are the library's own
        assert bridge.rerouted == [] and torch.equal(bridge(ids), expected)
    with pytest.raises(NotImplementedError, match=r"integer dtype torch.uint8.*hqq HQQLinear"):
        W_Q(bridge, 0)  # not the placeholder float weight
    q_proj = hqq_llama.model.layers[0].self_attn.q_proj
    with bridge.dequantized():
        w_q = W_Q(bridge, 0)
    # [out, in] rows are head-major: W_Q[h, :, d] = W[h * d_head + d, :]
    assert torch.equal(w_q, q_proj.dequantize().reshape(4, 16, 64).transpose(1, 2))
    rows = {row.name: row for row in audit_weights(hqq_llama).rows}
    row = rows["model.layers.0.self_attn.q_proj.weight"]
    assert row.format == "hqq" and not row.readable and row.shape == [64, 64]
    assert row.bytes == 64 * 64 // 2 + 2 * 128 * 4  # nibbles, fp32 zero and scale per 32


def test_save_quantized_round_trip(hqq_llama, tmp_path):
    import copy

    model = copy.deepcopy(hqq_llama)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = model(ids).logits
        with pytest.raises(ValueError, match="quantized by a library"):
            qlens.save_quantized(model, tmp_path / "refused")
        assert len(to_quant_linears(model)) == 7
        assert torch.equal(model(ids).logits, expected)
        qlens.save_quantized(model, tmp_path / "saved")
        reloaded = qlens.load_quantized(tmp_path / "saved")
        assert torch.equal(reloaded(ids).logits, expected)
