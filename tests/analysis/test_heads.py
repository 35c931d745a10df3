"""Head detection: exact scores on hand-built patterns, and induction heads in SmolLM2 (float,
MXFP4 and FP8-block)."""

from __future__ import annotations

import pytest
import torch

from qlens import analysis

# [a b c a b c]: induction targets are k = 1, 2, 3 from q = 3, 4, 5; duplicates k = 0, 1, 2.
TOKENS = torch.tensor([[5, 6, 7, 5, 6, 7]])


def _patterns() -> torch.Tensor:
    """[layer=1 batch=1 head=3 q k]: previous-token, uniform causal, perfect induction."""
    n = TOKENS.shape[1]
    previous = torch.zeros(n, n)
    previous[0, 0] = 1
    previous[torch.arange(1, n), torch.arange(n - 1)] = 1
    uniform = torch.tril(torch.ones(n, n))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    induction = torch.zeros(n, n)
    induction[:3, 0] = 1
    induction[torch.tensor([3, 4, 5]), torch.tensor([1, 2, 3])] = 1
    return torch.stack([previous, uniform, induction])[None, None]


def test_scores_on_hand_built_patterns():
    patterns = _patterns()
    prev = analysis.score_patterns(patterns, TOKENS, "previous_token")[0]
    dup = analysis.score_patterns(patterns, TOKENS, "duplicate_token")[0]
    ind = analysis.score_patterns(patterns, TOKENS, "induction")[0]
    uniform_prev = sum(1 / (q + 1) for q in range(1, 6)) / 5
    uniform_late = (1 / 4 + 1 / 5 + 1 / 6) / 3
    torch.testing.assert_close(prev, torch.tensor([1.0, uniform_prev, 0.2]))
    torch.testing.assert_close(dup, torch.tensor([0.0, uniform_late, 0.0]))
    torch.testing.assert_close(ind, torch.tensor([0.0, uniform_late, 1.0]))


def test_scoring_needs_targets_and_known_kinds():
    with pytest.raises(ValueError, match="no position with a induction target"):
        analysis.score_patterns(_patterns(), torch.tensor([[1, 2, 3, 4, 5, 6]]), "induction")
    with pytest.raises(ValueError, match="unknown head kind 'copy'"):
        analysis.score_patterns(_patterns(), TOKENS, "copy")


def test_repeated_random_tokens():
    tokens = analysis.repeated_random_tokens(50, 8, batch=3, seed=1, bos_token_id=0, low=10)
    assert tokens.shape == (3, 17) and bool((tokens[:, 0] == 0).all())
    assert torch.equal(tokens[:, 1:9], tokens[:, 9:])
    assert int(tokens[:, 1:].min()) >= 10 and int(tokens.max()) < 50


def _top(scores: torch.Tensor, k: int) -> set[tuple[int, int]]:
    flat = scores.flatten().topk(k).indices
    return {(int(i) // scores.shape[1], int(i) % scores.shape[1]) for i in flat}


@pytest.mark.slow
def test_induction_heads_in_smollm2_and_its_quantized_versions(smollm2, smollm2_quantized):
    tokens = analysis.repeated_random_tokens(
        smollm2.cfg.d_vocab, 20, seed=0, bos_token_id=smollm2.tokenizer.bos_token_id, low=100
    )
    scores = analysis.head_scores(smollm2, tokens)
    induction = scores["induction"].values
    assert induction.shape == (smollm2.cfg.n_layers, smollm2.cfg.n_heads)
    baseline = induction.median()  # a typical (random) head
    assert float(induction.max()) > 0.5 > 10 * float(baseline)
    best = _top(induction, 3)
    for scheme in ("mxfp4", "fp8-block"):
        quantized = analysis.head_scores(smollm2_quantized(scheme), tokens, kinds=["induction"])
        again = quantized["induction"].values
        assert float(again.max()) > 0.5 > 10 * float(again.median()), scheme
        assert best & _top(again, 5), scheme  # the same induction heads stand out
