"""The public names of ``qlens`` resolve, and unknown names fail clearly."""

import pytest

import qlens


@pytest.mark.parametrize("name", qlens.__all__)
def test_public_name_resolves(name: str) -> None:
    assert getattr(qlens, name) is not None
    assert name in dir(qlens)


def test_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'W_Qx'"):
        qlens.W_Qx  # noqa: B018
