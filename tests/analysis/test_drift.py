"""Quantization drift: exact values on controlled pairs, and a report for each scheme."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from analysis_models import tiny_model
from torch.distributions import Categorical, kl_divergence

from qlens import analysis
from qlens.bridge import Bridge

TOKENS = torch.randint(3, 1000, (2, 7), generator=torch.Generator().manual_seed(0))


def test_identical_models_do_not_drift():
    bridge = Bridge(tiny_model("llama"))
    report = analysis.quantization_drift(bridge, bridge, TOKENS, k=3)
    assert report.n_tokens == 14 and report.k == 3
    torch.testing.assert_close(torch.tensor(report.resid_cosine), torch.ones(2))
    torch.testing.assert_close(torch.tensor(report.resid_rel_error), torch.zeros(2))
    torch.testing.assert_close(torch.tensor(report.pattern_change), torch.zeros(2, 4))
    assert abs(report.logit_kl) < 1e-6
    assert report.top1_agreement == 1.0 and report.topk_overlap == 1.0
    assert json.loads(json.dumps(report.to_dict())) == report.to_dict()


def test_drift_of_a_changed_unembedding_matches_independent_oracles():
    reference = Bridge(tiny_model("llama"))
    model = copy.deepcopy(tiny_model("llama"))
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape) * 0.05)
    changed = Bridge(model)
    report = analysis.quantization_drift(reference, changed, TOKENS, k=5)
    torch.testing.assert_close(torch.tensor(report.resid_cosine), torch.ones(2))  # same stream
    with torch.no_grad():
        ref_logits, new_logits = reference(TOKENS), changed(TOKENS)
    kl = kl_divergence(Categorical(logits=ref_logits), Categorical(logits=new_logits)).mean()
    assert abs(report.logit_kl - float(kl)) < 1e-5
    top1 = (ref_logits.argmax(-1) == new_logits.argmax(-1)).float().mean()
    assert report.top1_agreement == pytest.approx(float(top1))
    shared = [
        len(set(a.tolist()) & set(b.tolist())) / 5
        for a, b in zip(
            ref_logits.topk(5).indices.reshape(-1, 5),
            new_logits.topk(5).indices.reshape(-1, 5),
            strict=True,
        )
    ]
    assert report.topk_overlap == pytest.approx(sum(shared) / len(shared))


def test_pattern_change_is_total_variation():
    one_hot = torch.eye(4)[None, None]  # [batch head q k]
    shifted = torch.roll(one_hot, 1, dims=-1)
    half = 0.5 * one_hot + 0.5 * shifted
    assert torch.equal(analysis.drift.pattern_change(one_hot, shifted), torch.ones(1))
    torch.testing.assert_close(analysis.drift.pattern_change(one_hot, half), torch.tensor([0.5]))


def test_mismatched_models_are_refused():
    with pytest.raises(ValueError, match="the models differ in depth"):
        analysis.quantization_drift(
            Bridge(tiny_model("llama")), Bridge(tiny_model("gpt2")).__class__(
                _one_layer_llama()
            ), TOKENS
        )  # fmt: skip


def _one_layer_llama():
    import transformers

    config = copy.deepcopy(tiny_model("llama").config)
    config.num_hidden_layers = 1
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["mxfp4", "fp8-block"])
def test_drift_report_for_each_scheme_on_smollm2(smollm2, smollm2_quantized, scheme):
    tokens = smollm2.to_tokens("The capital of France is Paris. The capital of Italy is")
    report = analysis.quantization_drift(smollm2, smollm2_quantized(scheme), tokens)
    assert len(report.resid_cosine) == smollm2.cfg.n_layers
    assert all(-1.0 <= c <= 1.0 for c in report.resid_cosine)
    assert min(report.resid_cosine) > 0.5  # quantized, not broken
    assert report.logit_kl >= 0 and 0 <= report.top1_agreement <= 1
    assert len(report.pattern_change) == smollm2.cfg.n_layers
    assert json.loads(json.dumps(report.to_dict()))["k"] == 5
