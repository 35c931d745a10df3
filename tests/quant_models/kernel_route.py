"""Spy for the GPU tests: count the linears that take qlens' kernel route, refuse the reference."""

from __future__ import annotations

import pytest

from qlens.kernels import plan


def count_kernel_route(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per ``LinearPlan`` call on the kernel route; any payload falling
    back to the torch reference raises instead (patched for the rest of the test)."""
    calls: list[int] = []
    kernel = plan.LinearPlan._kernel

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        return kernel(self, *args, **kwargs)

    def no_fallback(x, payload, bias=None):  # noqa: ANN001, ANN202
        raise AssertionError(f"{payload.format.name} payload fell back to the torch reference")

    monkeypatch.setattr(plan.LinearPlan, "_kernel", counted)
    monkeypatch.setattr(plan, "reference_linear", no_fallback)
    return calls


def count_stacked_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by the sibling count of each stacked sibling GEMV launch
    (``SiblingGemv.stacked``, which eager groups and ``qlens::sibling_linear`` both run)."""
    import qlens.kernels.sibling_gemv as sibling_gemv

    launches: list[int] = []
    stacked = sibling_gemv.SiblingGemv.stacked

    def counted(self, x, biases):  # noqa: ANN001, ANN202
        launches.append(len(self.sizes))
        return stacked(self, x, biases)

    monkeypatch.setattr(sibling_gemv.SiblingGemv, "stacked", counted)
    return launches


def accelerate_experts_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts plans built from now on are taken as an accelerator's (the interpreter runs the
    kernels on CPU tensors; CPU plans run the expert loop otherwise)."""
    from qlens.kernels.experts import ExpertsPlan

    init = ExpertsPlan.__init__

    def accelerated(plan, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(plan, *args, **kwargs)
        plan._accelerated = True

    monkeypatch.setattr(ExpertsPlan, "__init__", accelerated)


def count_fused_moe_decodes(
    monkeypatch: pytest.MonkeyPatch, *, accelerate: bool = False
) -> list[int]:
    """A list that grows by one per fused MoE decode call (``FusedMoeDecode``, two launches),
    each still running; ``accelerate``: :func:`accelerate_experts_plans` too."""
    import qlens.kernels.moe_decode as moe_decode

    calls: list[int] = []
    run = moe_decode.FusedMoeDecode.__call__

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(1)
        return run(self, *args)

    monkeypatch.setattr(moe_decode.FusedMoeDecode, "__call__", counted)
    if accelerate:
        accelerate_experts_plans(monkeypatch)
    return calls
