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


# A patch writes the clean activation into one location's rows of the repeated corrupted batch.
Patch = Callable[[Tensor, Tensor], None]  # (activation rows, clean activation) -> None
Location = tuple[str, Patch]  # (hook name, patch)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size must be a positive int (patched locations per forward), got {batch_size!r}"
        )


def _patching_hook(patches: list[tuple[int, Patch]], clean: Tensor, rows: int) -> Any:
    def hook(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        for k, patch in patches:
            patch(x[k * rows : (k + 1) * rows], clean)
        return x

    return hook


def _sweep(
    bridge: Any,
    clean_cache: Any,
    corrupted_tokens: Tensor,
    metric: Metric,
    locations: list[Location],
    batch_size: int,
) -> list[float]:
    """``metric`` of the corrupted run with each location patched, ``batch_size`` locations per
    forward: location ``k`` of a forward patches rows ``k*b .. (k+1)*b`` of the corrupted batch
    repeated, and the metric reads those rows of the logits."""
    rows = corrupted_tokens.shape[0]
    values: list[float] = []
    for start in range(0, len(locations), batch_size):
        chunk = locations[start : start + batch_size]
        by_name: dict[str, list[tuple[int, Patch]]] = {}
        for k, (name, patch) in enumerate(chunk):
            by_name.setdefault(name, []).append((k, patch))
        hooks = [
            (name, _patching_hook(patches, clean_cache[name], rows))
            for name, patches in by_name.items()
        ]
        tokens = corrupted_tokens.repeat(len(chunk), 1)
        with torch.no_grad():
            logits = bridge.run_with_hooks(tokens, fwd_hooks=hooks)
        values += [_scalar(metric(part)) for part in logits.split(rows)]
    return values


def _at_position(pos: int) -> Patch:
    def patch(rows: Tensor, clean: Tensor) -> None:
        rows[:, pos] = clean[:, pos].to(rows.dtype)

    return patch


def _at_head(head: int) -> Patch:
    def patch(rows: Tensor, clean: Tensor) -> None:
        rows[..., head, :] = clean[..., head, :].to(rows.dtype)

    return patch


def patch_by_position(
    bridge: Any,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "corrupted_batch corrupted_pos"],
    metric: Metric,
    site: str = "resid_pre",
    *,
    batch_size: int = 8,
) -> Labeled:
    """Patch ``blocks.{l}.hook_{site}`` at each (layer, position) from the clean run.

    Values ``[layer pos]``: the metric of the corrupted run with that one activation patched.
    ``batch_size`` locations run in one forward (``batch_size`` times the batch; lower it to
    save memory, 1 runs one forward per location); the values do not depend on it.
    """
    if site not in SITES:
        raise ValueError(f"site must be 'resid_pre', 'attn_out' or 'mlp_out', got {site!r}")
    _check(clean_tokens, corrupted_tokens)
    _check_batch_size(batch_size)
    names = [f"blocks.{i}.hook_{site}" for i in range(bridge.cfg.n_layers)]
    with torch.no_grad():
        _, clean = bridge.run_with_cache(clean_tokens, names_filter=names)
    n_pos = clean_tokens.shape[-1]
    locations = [(name, _at_position(pos)) for name in names for pos in range(n_pos)]
    swept = _sweep(bridge, clean, corrupted_tokens, metric, locations, batch_size)
    values = torch.tensor(swept).reshape(len(names), n_pos)
    labels = {"layer": [str(i) for i in range(len(names))], "pos": [str(p) for p in range(n_pos)]}
    return Labeled(values, ("layer", "pos"), labels)


def patch_heads(
    bridge: Any,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "corrupted_batch corrupted_pos"],
    metric: Metric,
    *,
    batch_size: int = 8,
) -> Labeled:
    """Patch each head's ``attn.hook_z`` (all positions) from the clean run: values
    ``[layer head]``. ``batch_size`` heads run in one forward, as in :func:`patch_by_position`."""
    _check(clean_tokens, corrupted_tokens)
    _check_batch_size(batch_size)
    names = [f"blocks.{i}.attn.hook_z" for i in range(bridge.cfg.n_layers)]
    with torch.no_grad():
        _, clean = bridge.run_with_cache(clean_tokens, names_filter=names)
    n_heads = bridge.cfg.n_heads
    locations = [(name, _at_head(head)) for name in names for head in range(n_heads)]
    swept = _sweep(bridge, clean, corrupted_tokens, metric, locations, batch_size)
    values = torch.tensor(swept).reshape(len(names), n_heads)
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
