"""TransformerLens' own analysis tools (activation patching, head detection, test_prompt) run on
a qlens bridge and give TransformerLens' results on the same SmolLM2 weights.

Patching metrics are logit differences of O(1-10) computed by the same forwards; rtol/atol 1e-4
allows for fp32 rounding of the metric.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from tl_oracle import tl_bridge
from transformer_lens import patching
from transformer_lens.head_detector import detect_head
from transformer_lens.utilities import test_prompt as tl_test_prompt

pytestmark = pytest.mark.slow

CLEAN = "Paris is the capital of"
CORRUPT = "Rome is the capital of"


@pytest.fixture(scope="module")
def tl_smollm2(smollm2):
    return tl_bridge(smollm2.model, smollm2.tokenizer)


def _patch_resid_pre(model):
    clean = model.to_tokens(CLEAN)
    corrupt = model.to_tokens(CORRUPT)
    assert clean.shape == corrupt.shape
    france, italy = model.to_single_token(" France"), model.to_single_token(" Italy")
    _, clean_cache = model.run_with_cache(clean)

    def metric(logits):
        return logits[0, -1, france] - logits[0, -1, italy]

    return patching.get_act_patch_resid_pre(model, corrupt, clean_cache, metric)


def test_activation_patching_agrees(smollm2, tl_smollm2):
    with torch.no_grad():
        ours, theirs = _patch_resid_pre(smollm2), _patch_resid_pre(tl_smollm2)
    assert ours.shape == theirs.shape == (smollm2.cfg.n_layers, smollm2.to_tokens(CLEAN).shape[1])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.abs().max() > 1  # the patch moves the answer


@pytest.mark.parametrize("kind", ["previous_token_head", "duplicate_token_head", "induction_head"])
def test_detect_head_agrees(smollm2, tl_smollm2, kind):
    text = "The cat sat on the mat. The cat sat on the mat."
    with torch.no_grad():
        ours = detect_head(smollm2, text, kind)
        theirs = detect_head(tl_smollm2, text, kind)
    assert ours.shape == (smollm2.cfg.n_layers, smollm2.cfg.n_heads)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def _printed(fn):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.no_grad():
        fn()
    return out.getvalue()


def test_test_prompt_agrees(smollm2, tl_smollm2):
    ours = _printed(lambda: tl_test_prompt("The capital of France is", "Paris", smollm2))
    theirs = _printed(lambda: tl_test_prompt("The capital of France is", "Paris", tl_smollm2))
    assert "Paris" in ours
    assert ours == theirs
