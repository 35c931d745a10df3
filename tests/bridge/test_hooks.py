"""HookPoint: identity by default, replacement, validation, handles, backward hooks."""

from __future__ import annotations

import pytest
import torch

from qlens.hooks import HookPoint


def test_identity_without_hooks_and_replacement_in_order() -> None:
    point = HookPoint("blocks.0.hook_resid_pre")
    x = torch.randn(2, 3)
    assert point(x) is x
    seen = []
    point.add_hook(lambda t, hook: seen.append(hook.name))
    point.add_hook(lambda t, hook: t * 2)
    point.add_hook(lambda t, hook: t + 1)
    assert torch.equal(point(x), x * 2 + 1)
    assert seen == ["blocks.0.hook_resid_pre"]


def test_handle_removes_only_its_hook() -> None:
    point = HookPoint("p")
    h1 = point.add_hook(lambda t, hook: t * 3)
    point.add_hook(lambda t, hook: t + 1)
    h1.remove()
    h1.remove()
    x = torch.ones(2)
    assert torch.equal(point(x), x + 1)
    point.remove_hooks()
    assert not point.is_active and point(x) is x


def test_permanent_and_prepended_hooks() -> None:
    """A permanent hook stays through ``remove_hooks`` unless ``including_permanent``; its
    handle still removes it; ``prepend`` runs a hook before those already there; the context
    is kept when asked."""
    point = HookPoint("p")
    double = lambda t, hook: t * 2  # noqa: E731
    handle = point.add_hook(double, is_permanent=True)
    point.add_hook(lambda t, hook: t + 1)
    point.add_hook(lambda t, hook: t - 5, prepend=True)
    x = torch.ones(2)
    assert torch.equal(point(x), (x - 5) * 2 + 1)
    point.ctx["seen"] = 1
    point.remove_hooks(clear_context=False)
    assert point.fwd_hooks == [double] and point.ctx == {"seen": 1}
    point.remove_hooks()
    assert point.fwd_hooks == [double] and point.ctx == {}
    point.remove_hooks(including_permanent=True)
    assert not point.is_active and not point.permanent
    point.add_hook(double, is_permanent=True)
    point.add_hook(double, dir="bwd", is_permanent=True)
    handle = point.add_hook(double, is_permanent=True)
    handle.remove()
    point.remove_hooks("fwd")
    assert point.fwd_hooks == [double] and point.bwd_hooks == [double]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda t, hook: t[:1], r"shape \(1, 3\).*activation has shape \(2, 3\)"),
        (lambda t, hook: t.double(), r"dtype torch.float64"),
        (lambda t, hook: t.tolist(), r"returned list"),
    ],
)
def test_bad_return_raises_naming_the_hook(bad, message: str) -> None:  # noqa: ANN001
    point = HookPoint("blocks.1.attn.hook_z")
    point.add_hook(bad)
    with pytest.raises((ValueError, TypeError), match=r"blocks\.1\.attn\.hook_z") as info:
        point(torch.randn(2, 3))
    assert info.match(message)


def test_bad_direction_and_non_callable() -> None:
    point = HookPoint("p")
    with pytest.raises(ValueError, match="'fwd' or 'bwd'"):
        point.add_hook(lambda t, hook: None, dir="both")
    with pytest.raises(TypeError):
        point.add_hook(3)


def test_backward_hook_sees_and_replaces_gradient() -> None:
    point = HookPoint("p")
    grads = []
    point.add_hook(lambda g, hook: grads.append(g.clone()), dir="bwd")
    point.add_hook(lambda g, hook: g * 10, dir="bwd")
    x = torch.randn(3, requires_grad=True)
    (point(x * 1.0) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(x.grad, torch.tensor([10.0, 20.0, 30.0]))
