"""FactoredMatrix against the materialized product, and composition scores against their
definition computed on full matrices."""

from __future__ import annotations

import pytest
import torch
from arch_models import tiny_model

from qlens.bridge import Bridge
from qlens.weights import FactoredMatrix, circuits
from qlens.weights import accessors as A

TOL = dict(atol=1e-4, rtol=1e-4)


def _factors(batch=(2,), ldim=6, mdim=3, rdim=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, ldim, mdim, generator=generator, dtype=torch.float64)
    b = torch.randn(*batch, mdim, rdim, generator=generator, dtype=torch.float64)
    return a, b


def test_products_transpose_and_matmul():
    a, b = _factors()
    fm = FactoredMatrix(a, b)
    full = a @ b
    assert fm.shape == full.shape and torch.equal(fm.AB, full)
    assert torch.allclose(fm.T.AB, full.mT)
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.allclose((fm @ x).AB if isinstance(fm @ x, FactoredMatrix) else fm @ x, full @ x)
    y = torch.randn(7, 6, dtype=torch.float64)
    left = y @ fm
    assert torch.allclose(left.AB if isinstance(left, FactoredMatrix) else left, y @ full)
    other = FactoredMatrix(*_factors(ldim=5, rdim=4, seed=1))
    assert torch.allclose((fm @ other).AB, full @ other.AB)
    assert torch.allclose((2.5 * fm).AB, 2.5 * full)
    vector = torch.randn(5, dtype=torch.float64)
    assert torch.allclose(fm @ vector, full @ vector)


def test_svd_norm_and_eigenvalues_match_the_full_matrix():
    a, b = _factors(ldim=6, mdim=3, rdim=6)
    fm, full = FactoredMatrix(a, b), a @ b
    u, s, v = fm.svd()
    assert torch.allclose(u @ torch.diag_embed(s) @ v.mT, full, **TOL)
    assert torch.allclose(s, torch.linalg.svdvals(full)[..., :3], **TOL)
    assert torch.allclose(u.mT @ u, torch.eye(3, dtype=u.dtype).expand(2, 3, 3), **TOL)
    assert torch.allclose(fm.norm(), full.norm(dim=(-2, -1)), **TOL)
    full_eigs = torch.linalg.eigvals(full)
    for batch in range(2):  # the nonzero eigenvalues of AB are those of BA
        ours = sorted(fm.eigenvalues[batch].tolist(), key=lambda z: (round(z.real, 6), z.imag))
        theirs = [z for z in full_eigs[batch].tolist() if abs(z) > 1e-8]
        theirs = sorted(theirs, key=lambda z: (round(z.real, 6), z.imag))
        assert len(ours) == len(theirs)
        assert all(abs(p - q) < 1e-6 for p, q in zip(ours, theirs, strict=True))
    assert torch.allclose(fm.collapse_l(), torch.diag_embed(s) @ v.mT, **TOL)
    assert torch.allclose(fm.get_corner(2), full[..., :2, :2])


def test_indexing_stays_factored():
    a, b = _factors(batch=(3, 2))
    fm, full = FactoredMatrix(a, b), a @ b
    assert torch.allclose(fm[1].AB, full[1])
    assert torch.allclose(fm[2, 0].AB, full[2, 0])
    row = fm[2, 0, 3]
    assert isinstance(row, FactoredMatrix) and torch.allclose(row.AB, full[2, 0, 3:4])
    assert torch.allclose(fm[:, 1, 1:4, -1].AB, full[:, 1, 1:4, -1:])
    with pytest.raises(IndexError, match="out of range"):
        fm[0, 0, 6]


def test_mismatched_factors_are_refused():
    with pytest.raises(ValueError, match="inner dimensions differ"):
        FactoredMatrix(torch.zeros(3, 4), torch.zeros(5, 2))
    with pytest.raises(ValueError, match="square product"):
        _ = FactoredMatrix(torch.zeros(3, 2), torch.zeros(2, 4)).BA


def _full_score(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """TransformerLens' definition on materialized matrices."""
    return (left @ right).norm() / (left.norm() * right.norm())


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_follow_the_definition(mode):
    bridge = Bridge(tiny_model("llama"))
    scores = circuits.all_composition_scores(bridge, mode)
    n_layers, n_heads = bridge.cfg.n_layers, bridge.cfg.n_heads
    assert scores.shape == (n_layers, n_heads, n_layers, n_heads)
    w_q, w_k = A.W_Q(bridge), A.W_K(bridge, repeat_kv=True)
    w_v, w_o = A.W_V(bridge, repeat_kv=True), A.W_O(bridge)
    ov = w_v @ w_o
    right = {"Q": w_q @ w_k.mT, "K": (w_q @ w_k.mT).mT, "V": ov}[mode]
    for h1 in range(n_heads):
        for h2 in range(n_heads):
            expected = _full_score(ov[0, h1].double(), right[1, h2].double())
            assert abs(scores[0, h1, 1, h2].item() - expected.item()) < 1e-5
    assert torch.equal(scores[1], torch.zeros_like(scores[1]))  # no later layer
    assert torch.equal(scores[0, :, 0], torch.zeros_like(scores[0, :, 0]))  # same layer


def test_circuits_are_the_products_of_the_accessors():
    bridge = Bridge(tiny_model("gpt2"))
    qk, ov = circuits.QK_circuit(bridge, 1), circuits.OV_circuit(bridge)
    assert torch.allclose(qk.AB, A.W_Q(bridge, 1) @ A.W_K(bridge, 1).mT)
    assert ov.shape == (bridge.cfg.n_layers, bridge.cfg.n_heads, 64, 64)
    assert torch.allclose(ov[1, 2].AB, A.W_V(bridge, 1)[2] @ A.W_O(bridge, 1)[2])
