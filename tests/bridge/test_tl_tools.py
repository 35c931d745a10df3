"""TransformerLens' own tools (patching, detect_head, test_prompt) run on a qlens Bridge and agree
with the same tools on a TransformerLens bridge of the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from bridge_models import make_word_tokenizer, tiny_model
from tl_oracle import tl_bridge

from qlens import Bridge

# Both libraries run the same HF modules in fp32 (TL: eager attention, qlens: the model's own);
# a 2-layer, 64-wide model's logits agree to ~2e-7, so metrics built on them agree to 1e-5.
FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def bos_tokenizer() -> T.PreTrainedTokenizerFast:
    """A word tokenizer that adds BOS itself, so both libraries tokenize strings identically."""
    return make_word_tokenizer(prepend_bos=True)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, bos_tokenizer):
    model = tiny_model(request.param)
    return Bridge(model, bos_tokenizer), tl_bridge(model, bos_tokenizer)


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, 5] - logits[0, -1, 6]


def test_activation_patching_agrees(pair):
    from transformer_lens import patching

    bridge, tl = pair
    clean = tl.to_tokens("the cat sat on the mat")
    corrupted = tl.to_tokens("the dog ran to the park")
    assert torch.equal(clean, bridge.to_tokens("the cat sat on the mat"))
    results = []
    for model in (bridge, tl):
        _, cache = model.run_with_cache(clean)
        results.append(
            (
                patching.get_act_patch_resid_pre(model, corrupted, cache, _metric),
                patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, _metric),
            )
        )
    (resid, heads), (tl_resid, tl_heads) = results
    assert resid.shape == (2, clean.shape[1]) and heads.shape == (2, clean.shape[1], 4)
    torch.testing.assert_close(resid, tl_resid, **FP32)
    torch.testing.assert_close(heads, tl_heads, **FP32)
    assert resid.abs().max() > 0.01  # the patches change the metric: the comparison means something


def test_detect_head_agrees(pair):
    from transformer_lens.head_detector import detect_head

    bridge, tl = pair
    prompt = "the cat sat on the mat the cat sat on the mat"
    for pattern in ("previous_token_head", "duplicate_token_head", "induction_head"):
        ours = detect_head(bridge, prompt, pattern)
        assert ours.shape == (2, 4) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, detect_head(tl, prompt, pattern), **FP32)


def test_test_prompt_prints_the_same(pair, capsys):
    from transformer_lens.utilities import test_prompt

    bridge, tl = pair
    outputs = []
    for model in (bridge, tl):
        test_prompt("the cat sat on the", "mat", model, prepend_space_to_answer=False, top_k=3)
        outputs.append(capsys.readouterr().out)
    assert "Tokenized prompt: ['<bos>', 'the', 'cat', 'sat', 'on', 'the']" in outputs[0]
    assert outputs[0] == outputs[1]  # ranks, logits and probabilities printed to 2 decimals


def test_patching_refuses_a_bridge_in_training_mode(pair):
    from transformer_lens import patching

    bridge, _ = pair
    tokens = bridge.to_tokens("the cat sat")
    _, cache = bridge.run_with_cache(tokens)
    bridge.train()
    try:
        with pytest.raises(ValueError, match="requires the model and all submodules"):
            patching.get_act_patch_resid_pre(bridge, tokens, cache, _metric)
    finally:
        bridge.eval()
