"""Weights, schemes and error measures shared by the kernel tests."""

from __future__ import annotations

import torch
from grouped_launches import grouped_launch_grids

from qlens.kernels.fast_launch import PreparedLaunch
from qlens.quant.payload import QuantPayload
from qlens.quant.quantize import quantize_weight

# (scheme, options) covering every family and variant the kernels read.
SCHEMES: tuple[tuple[str, dict[str, object]], ...] = (
    ("fp8-block", {}),
    ("fp8-block", {"scale_dtype": "e8m0"}),
    ("fp8-block", {"block_size": (32, 64)}),
    ("mxfp8", {}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("int4", {"group_size": 32}),
    ("int4", {"group_size": 128, "asymmetric": True, "scale_dtype": "bf16"}),
    ("int8", {"group_size": 64}),
    ("int8", {"group_size": 32, "asymmetric": True, "scale_dtype": "fp16"}),
)


def scheme_id(case: tuple[str, dict[str, object]]) -> str:
    scheme, options = case
    return scheme + "".join(f"-{k}={v}" for k, v in options.items())


def quantized(n: int, k: int, case: tuple[str, dict[str, object]], seed: int = 0) -> QuantPayload:
    """A payload of a random ``[n, k]`` weight with outliers, from qlens' own quantizer."""
    gen = torch.Generator().manual_seed(seed)
    w = (
        torch.randn(n, k, generator=gen)
        * torch.logspace(-2, 1, k)[torch.randperm(k, generator=gen)]
    )
    scheme, options = case
    return quantize_weight(w, scheme, **options)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``|out - ref| / |ref|`` in float64 (NaN never passes)."""
    out64, ref64 = out.double(), ref.double()
    err = ((out64 - ref64).norm() / ref64.norm()).item()
    return err if err == err else float("inf")


def count_grouped_launches(monkeypatch) -> list:
    """The grids of the grouped experts GEMM's launches from now on, with ``"decoded"`` for each
    call of experts decoded then multiplied by ``torch._grouped_mm`` (``DecodedExperts``, the
    bf16 prefill route on Hopper); each launch and call still runs."""
    from qlens.kernels.decoded_experts import DecodedExperts

    grids = grouped_launch_grids(monkeypatch)
    decoded = DecodedExperts.on_sorted
    monkeypatch.setattr(
        DecodedExperts,
        "on_sorted",
        lambda self, *args: grids.append("decoded") or decoded(self, *args),
    )
    return grids


def record_grouped_launches_without_host_reads(patch) -> list:
    """Within the monkeypatch context ``patch``: every way a tensor's value reaches Python
    raises, the per-expert loop cannot run, and the grouped experts GEMM's launches are
    recorded as ``(args, options)`` (with the grid, three dimensions, first in ``args``), not
    run."""
    import qlens.kernels.experts as experts_module
    import qlens.kernels.grouped_experts as grouped_module

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__"):
        patch.setattr(torch.Tensor, name, host_read)
    patch.setattr(experts_module, "quantized_linear", None)  # no per-expert launches
    recorded: list = []
    real = PreparedLaunch.__call__

    def record(self: PreparedLaunch, *tensors: torch.Tensor) -> None:
        if self.launcher is not grouped_module.GROUPED_EXPERTS:
            return real(self, *tensors)
        recorded.append(((self.grid, *self.arguments(*tensors)), self.options))
        return None

    patch.setattr(PreparedLaunch, "__call__", record)
    return recorded
