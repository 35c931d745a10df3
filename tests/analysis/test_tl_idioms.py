"""TransformerLens idioms run unchanged on a TransformerLens model and on a qlens bridge over
the same SmolLM2 weights (fp32), with the same results.

Both run the same HF forward, so activations agree exactly; reductions over d_model = 576 or
the vocabulary in a different order agree to fp32 rounding (rtol/atol 1e-4 on O(1-10) values).
"""

from __future__ import annotations

import pytest
import torch
from tl_idioms import IDIOMS
from tl_oracle import tl_bridge

pytestmark = pytest.mark.slow

# idioms that need a feature not in qlens yet: name -> the missing feature
MISSING: dict[str, str] = {}


@pytest.fixture(scope="module")
def tl_smollm2(smollm2):
    return tl_bridge(smollm2.model, smollm2.tokenizer)


def assert_same(ours, theirs, where: str = "result") -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: {type(ours).__name__}, not a tensor"
        torch.testing.assert_close(
            ours, theirs.to(ours.dtype), rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {m}"
        )
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)), f"{where}: {type(ours).__name__}, not a sequence"
        assert len(ours) == len(theirs), f"{where}: {len(ours)} items, TL has {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, rel=1e-5), where
    elif isinstance(theirs, torch.Size):
        assert tuple(ours) == tuple(theirs), where
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _cases():
    for name in IDIOMS:
        marks = [pytest.mark.xfail(strict=True, reason=MISSING[name])] if name in MISSING else []
        yield pytest.param(name, marks=marks, id=name)


def test_there_are_enough_idioms():
    assert len(IDIOMS) >= 60


@pytest.mark.parametrize("name", list(_cases()))
def test_idiom_runs_unchanged(name, smollm2, tl_smollm2):
    idiom = IDIOMS[name]
    with torch.no_grad():
        theirs = idiom(tl_smollm2)
        ours = idiom(smollm2)
    assert_same(ours, theirs)
