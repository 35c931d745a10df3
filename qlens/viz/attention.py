"""Attention-pattern explorer: pick a layer and a head; reference and quantized side by side."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import ipywidgets as widgets
import torch
from jaxtyping import Float
from torch import Tensor

from qlens.bridge.cache import ActivationCache
from qlens.viz import static
from qlens.viz.viewer import Viewer

_PATTERN_NAME = re.compile(r"blocks\.(\d+)\.attn\.hook_pattern")

PatternSource = ActivationCache | Mapping[str, Tensor] | Tensor


def stack_patterns(source: PatternSource, batch: int = 0) -> Float[Tensor, "layer head q k"]:
    """Every layer's attention pattern of one sequence, stacked.

    ``source`` is an ``ActivationCache`` (or a dict) holding ``blocks.{i}.attn.hook_pattern``
    entries, with or without the batch dim, or an already stacked ``[layer head q k]`` tensor.
    """
    if isinstance(source, Tensor):
        if source.ndim != 4:
            raise ValueError(
                f"a stacked pattern tensor must be [layer head q k], got shape {tuple(source.shape)}"
            )
        return source.detach().float().cpu()
    found = sorted(
        (int(m.group(1)), name) for name in source if (m := _PATTERN_NAME.fullmatch(name))
    )
    if not found:
        raise ValueError(
            "no attention patterns found: the cache has no blocks.{i}.attn.hook_pattern entries. "
            "Run bridge.run_with_cache(...) with names_filter=None or one that keeps "
            "'attn.hook_pattern'."
        )
    layers = [layer for layer, _ in found]
    if layers != list(range(len(layers))):
        raise ValueError(
            f"patterns are cached for layers {layers}; cache every layer from 0 without gaps "
            "(names_filter=lambda n: n.endswith('hook_pattern'))"
        )
    patterns = []
    for _, name in found:
        value = source[name]
        if value.ndim == 4:
            if not 0 <= batch < value.shape[0]:
                raise ValueError(
                    f"batch index {batch} is out of range for {name} {tuple(value.shape)}"
                )
            value = value[batch]
        elif value.ndim != 3:
            raise ValueError(
                f"{name} must be [batch head q k] or [head q k], got {tuple(value.shape)}"
            )
        patterns.append(value.detach().float().cpu())
    return torch.stack(patterns)


class AttentionExplorer(Viewer):
    """Attention patterns of one sequence with ``layer`` and ``head`` selectors.

    Given ``compare`` (e.g. the cache of a quantized model on the same tokens), the view shows
    the reference, the comparison and their difference side by side.
    """

    def __init__(
        self,
        patterns: PatternSource,
        tokens: Sequence[str],
        compare: PatternSource | None = None,
        *,
        labels: tuple[str, str] = ("reference", "quantized"),
        batch: int = 0,
    ) -> None:
        self.patterns = stack_patterns(patterns, batch)
        self.compare = None if compare is None else stack_patterns(compare, batch)
        n_layers, n_heads, n_query, n_key = self.patterns.shape
        if self.compare is not None and self.compare.shape != self.patterns.shape:
            raise ValueError(
                f"compare patterns have shape {tuple(self.compare.shape)} but the reference has "
                f"{tuple(self.patterns.shape)}; cache both models on the same tokens"
            )
        if len(tokens) != n_key:
            raise ValueError(
                f"got {len(tokens)} token labels for patterns over {n_key} positions; pass "
                "bridge.to_str_tokens(...) of the same input"
            )
        self.tokens = list(tokens)
        self.labels = labels
        self.layer = widgets.IntSlider(value=0, min=0, max=n_layers - 1, description="layer")
        self.head = widgets.IntSlider(value=0, min=0, max=n_heads - 1, description="head")
        self._finish([self.layer, self.head])

    @property
    def displayed(self) -> dict[str, Float[Tensor, "q k"]]:
        """The patterns currently shown, by panel name."""
        reference = self.patterns[self.layer.value, self.head.value]
        if self.compare is None:
            return {self.labels[0]: reference}
        other = self.compare[self.layer.value, self.head.value]
        return {self.labels[0]: reference, self.labels[1]: other, "difference": other - reference}

    def _render_html(self) -> str:
        title = f"layer {self.layer.value}, head {self.head.value}"
        return static.attention_pattern(self.displayed, self.tokens, title)
