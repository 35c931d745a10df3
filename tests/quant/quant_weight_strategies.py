"""Hypothesis strategies for test weights: ragged shapes, many binades, zero and subnormal groups."""

import torch
from hypothesis import strategies as st


@st.composite
def weights(draw, max_rows=40, max_cols=70, experts=True, min_exponent=-60, max_exponent=60):
    """A float32 weight ``[N, K]`` or ``[E, N, K]`` whose 16-column groups span many binades.

    Some groups are all zero and some are subnormal (around 2**-140).
    """
    lead = (draw(st.integers(1, 3)),) if experts and draw(st.booleans()) else ()
    n, k = draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // 16)
    w = torch.randn((*lead, n, groups * 16), generator=gen)
    exponents = torch.randint(min_exponent, max_exponent + 1, (*lead, n, groups), generator=gen)
    kind = torch.randint(0, 10, (*lead, n, groups), generator=gen)
    exponents = torch.where(kind == 0, torch.full_like(exponents, -140), exponents)
    scale = torch.ldexp(torch.ones(exponents.shape), exponents)
    scale = torch.where(kind == 1, torch.zeros_like(scale), scale)
    w = (w.unflatten(-1, (groups, 16)) * scale.unsqueeze(-1)).flatten(-2)
    return w[..., :k].contiguous()
