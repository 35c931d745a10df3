"""Activation patching sweeps: run corrupted inputs with one clean activation patched in.

Each sweep returns a :class:`Labeled` of ``metric(logits)`` per patched location.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.analysis.labeled import Labeled

Metric = Callable[[Tensor], Tensor | float]
SITES = ("resid_pre", "attn_out", "mlp_out")


def _check(clean: Tensor, corrupted: Tensor) -> None:
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean tokens {list(clean.shape)} and corrupted tokens {list(corrupted.shape)} must "
            "have the same shape: patching swaps activations position by position"
        )


def _scalar(value: Tensor | float) -> float:
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise ValueError(f"the metric must return a scalar, got shape {list(tensor.shape)}")
    return float(tensor)


def patch_by_position(
    bridge: Any,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "corrupted_batch corrupted_pos"],
    metric: Metric,
    site: str = "resid_pre",
) -> Labeled:
    """Patch ``blocks.{l}.hook_{site}`` at each (layer, position) from the clean run.

    Values ``[layer pos]``: the metric of the corrupted run with that one activation patched.
    """
    if site not in SITES:
        raise ValueError(f"site must be 'resid_pre', 'attn_out' or 'mlp_out', got {site!r}")
    _check(clean_tokens, corrupted_tokens)
    names = [f"blocks.{i}.hook_{site}" for i in range(bridge.cfg.n_layers)]
    _, clean = bridge.run_with_cache(clean_tokens, names_filter=names)
    n_pos = clean_tokens.shape[-1]
    values = torch.zeros(len(names), n_pos)
    for layer, name in enumerate(names):
        for pos in range(n_pos):

            def patch(x: Tensor, hook: Any, pos: int = pos, name: str = name) -> Tensor:
                x = x.clone()
                x[:, pos] = clean[name][:, pos].to(x.dtype)
                return x

            with torch.no_grad():
                logits = bridge.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, patch)])
            values[layer, pos] = _scalar(metric(logits))
    labels = {"layer": [str(i) for i in range(len(names))], "pos": [str(p) for p in range(n_pos)]}
    return Labeled(values, ("layer", "pos"), labels)


def patch_heads(
    bridge: Any,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "corrupted_batch corrupted_pos"],
    metric: Metric,
) -> Labeled:
    """Patch each head's ``attn.hook_z`` (all positions) from the clean run: values
    ``[layer head]``."""
    _check(clean_tokens, corrupted_tokens)
    names = [f"blocks.{i}.attn.hook_z" for i in range(bridge.cfg.n_layers)]
    _, clean = bridge.run_with_cache(clean_tokens, names_filter=names)
    n_heads = bridge.cfg.n_heads
    values = torch.zeros(len(names), n_heads)
    for layer, name in enumerate(names):
        for head in range(n_heads):

            def patch(z: Tensor, hook: Any, head: int = head, name: str = name) -> Tensor:
                z = z.clone()
                z[..., head, :] = clean[name][..., head, :].to(z.dtype)
                return z

            with torch.no_grad():
                logits = bridge.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, patch)])
            values[layer, head] = _scalar(metric(logits))
    labels = {
        "layer": [str(i) for i in range(len(names))],
        "head": [str(h) for h in range(n_heads)],
    }
    return Labeled(values, ("layer", "head"), labels)


def logit_diff_metric(
    correct: int | Int[Tensor, " batch"], incorrect: int | Int[Tensor, " batch"], pos: int = -1
) -> Callable[[Float[Tensor, "batch pos vocab"]], Float[Tensor, ""]]:
    """A metric: mean over the batch of ``logit[correct] - logit[incorrect]`` at ``pos``."""

    def metric(logits: Float[Tensor, "batch pos vocab"]) -> Float[Tensor, ""]:
        last = logits[:, pos]
        rows = torch.arange(last.shape[0], device=last.device)
        good = last[rows, torch.as_tensor(correct, device=last.device).expand(len(rows))]
        bad = last[rows, torch.as_tensor(incorrect, device=last.device).expand(len(rows))]
        return (good - bad).mean()

    return metric
