"""`qlens.load` on a .gguf file: quantized linears stay GGUF payloads in QuantLinear modules whose
weights are exactly those transformers' own (dequantizing) GGUF reader produces."""

from __future__ import annotations

import pytest
import torch

import qlens
from qlens import models
from qlens.modules import QuantLinear

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # reads the embedded SmolLM2 GGUF file twice


@pytest.fixture(scope="module")
def transformers_float():
    """The default model's GGUF read by transformers, dequantized to float32."""
    model, _ = models._load_gguf(models.smollm2_gguf_path())
    return model.eval()


@pytest.fixture(scope="module")
def packed():
    return qlens.load(models.smollm2_gguf_path())


def test_quantized_linears_stay_packed_with_transformers_weights(packed, transformers_float):
    quantized = {n: m for n, m in packed.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 30 * 7  # q, k, v, o, gate, up, down in each of the 30 layers
    for name, module in quantized.items():
        assert module.payload.data.dtype == torch.uint8, name
        expected = transformers_float.get_submodule(name).weight
        assert torch.equal(qlens.dequantize(module), expected), name  # q/k rows unpermuted too
    floats = dict(transformers_float.named_parameters())
    for name, tensor in packed.model.named_parameters():
        assert torch.equal(tensor, floats[name]), name
    assert packed.model.lm_head.weight is packed.model.model.embed_tokens.weight


def test_packed_model_predicts_like_the_float_one(packed, transformers_float):
    tokens = packed.to_tokens("The capital of France is")
    with torch.no_grad():
        ours, theirs = packed(tokens), transformers_float(tokens).logits
    # Same weights, fp32 matmuls whose summation order may differ between the two paths.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3 * theirs.abs().max().item())
    assert packed.tokenizer.decode(ours[0, -1].argmax()) == " Paris"


def test_gguf_files_refuse_options_that_do_not_apply():
    with pytest.raises(TypeError, match=r"GGUF file, .* quantize cannot be applied"):
        qlens.load(models.smollm2_gguf_path(), quantize="int4")
