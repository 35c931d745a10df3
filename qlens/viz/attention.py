"""Attention-pattern explorer: pick a layer and a head; reference and quantized side by side."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import ipywidgets as widgets
import torch
import traitlets
from jaxtyping import Float
from torch import Tensor

from qlens.bridge.cache import ActivationCache
from qlens.viz import static
from qlens.viz.arrays import float16_bytes, unit_uint8_bytes
from qlens.viz.browser import BrowserView, module_source
from qlens.viz.labels import visible_token
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


class AttentionView(BrowserView):
    """Every pattern of the sequence (uint8 levels of 1/255), and for a comparison the other
    model's patterns and the float16 difference; the selected ``layer`` and ``head``."""

    _esm = traitlets.Unicode(module_source("attention")).tag(sync=True)
    n_layers = traitlets.Int().tag(sync=True)
    n_heads = traitlets.Int().tag(sync=True)
    n_pos = traitlets.Int().tag(sync=True)
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    labels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    patterns = traitlets.Bytes().tag(sync=True)
    compare = traitlets.Bytes().tag(sync=True)
    difference = traitlets.Bytes().tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    head = traitlets.Int(0).tag(sync=True)


class AttentionExplorer(Viewer):
    """Attention patterns of one sequence with ``layer`` and ``head`` selectors.

    Given ``compare`` (e.g. the cache of a quantized model on the same tokens), the view shows
    the reference, the comparison and their difference side by side. In the browser it also
    shows every head of the selected layer (click one to select it) and, on hovering a token,
    the attention from or to it; none of this waits for the kernel. ``layer`` and ``head`` are
    ``IntSlider`` controls holding the selection in the kernel.
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
        if n_query != n_key:
            raise ValueError(
                f"patterns have {n_query} query and {n_key} key positions; the explorer shows "
                "the square patterns of one forward over the whole sequence (no KV cache)"
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
        view = AttentionView(
            n_layers=n_layers,
            n_heads=n_heads,
            n_pos=n_key,
            tokens=[visible_token(t) for t in self.tokens],
            labels=list(labels),
            patterns=unit_uint8_bytes(self.patterns),
            compare=b"" if self.compare is None else unit_uint8_bytes(self.compare),
            difference=b"" if self.compare is None else float16_bytes(self.compare - self.patterns),
        )
        self._finish(view, [(self.layer, "value", "layer"), (self.head, "value", "head")])

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
