"""The tests run qlens with its jaxtyping annotations checked (tests/conftest.py), except inside
code that torch.compile traces."""

from __future__ import annotations

import pytest
import torch
from beartype.roar import BeartypeCallHintViolation
from jaxtyping import TypeCheckError

from qlens.kernels.code_order import permute_codes


@pytest.mark.parametrize(
    "x",
    [torch.zeros(2, 64, dtype=torch.int32), torch.zeros(64)],
    ids=["integer dtype", "one dim"],
)
def test_an_annotated_shape_or_dtype_violation_raises(x: torch.Tensor) -> None:
    with pytest.raises((TypeCheckError, BeartypeCallHintViolation), match="permute_codes"):
        permute_codes(x)


def test_traced_calls_run_unchecked_and_give_the_eager_result() -> None:
    x = torch.randn(2, 64)
    traced = torch.compile(lambda t: permute_codes(t), backend="eager")
    assert torch.equal(traced(x), permute_codes(x))
