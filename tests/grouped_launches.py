"""Recording the grouped experts GEMM's prepared launches while they still run."""

from __future__ import annotations

import pytest
import torch

from qlens.kernels.fast_launch import PreparedLaunch


def grouped_launch_grids(monkeypatch: pytest.MonkeyPatch) -> list:
    """The grids (three dimensions) of the grouped experts GEMM's launches from now on; each
    launch still runs."""
    import qlens.kernels.grouped_experts as grouped_module

    grids: list = []
    real = PreparedLaunch.__call__

    def counted(launch: PreparedLaunch, *tensors: torch.Tensor) -> None:
        if launch.launcher is grouped_module.GROUPED_EXPERTS:
            grids.append(launch.grid)
        real(launch, *tensors)

    monkeypatch.setattr(PreparedLaunch, "__call__", counted)
    return grids
