"""transformers' ``FP8Experts`` with every tensor filled (it allocates them with ``torch.empty``)."""

from __future__ import annotations

import torch


def random_fp8_experts(config: object, block_size: tuple[int, int], seed: int) -> torch.nn.Module:
    """``FP8Experts(config, block_size)`` with e4m3 weights from ``randn * 60`` (saturating
    into the whole e4m3 range) and positive ``*_scale_inv`` in ``[1e-4, 1.1e-3)``."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    experts = FP8Experts(config, block_size=block_size)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weight, scale = getattr(experts, name), getattr(experts, f"{name}_scale_inv")
            weight.copy_((torch.randn(weight.shape, generator=gen) * 60).to(weight.dtype))
            scale.copy_(torch.rand(scale.shape, generator=gen) * 1e-3 + 1e-4)
    return experts
