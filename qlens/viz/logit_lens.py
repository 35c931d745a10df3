"""Logit-lens table: the top tokens each layer's residual stream predicts, per position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import torch
import traitlets
from jaxtyping import Float
from torch import Tensor

from qlens.viz import static
from qlens.viz.arrays import float16_bytes, uint32_bytes
from qlens.viz.browser import BrowserView, module_source
from qlens.viz.labels import position_labels, token_text, visible_token
from qlens.viz.viewer import Viewer

MAX_TOP_K = 10


def _nested_shape_is(
    nested: Sequence[Sequence[Sequence[str]]], shape: tuple[int, int, int]
) -> bool:
    n_layers, n_pos, n_ranks = shape
    return len(nested) == n_layers and all(
        len(row) == n_pos and all(len(cell) == n_ranks for cell in row) for row in nested
    )


def _flat(nested: list[list[list[int]]]) -> list[int]:
    return [i for row in nested for cell in row for i in cell]


class LogitLensView(BrowserView):
    """Ranked probabilities (float16) and token ids (uint32 indices into ``vocab``, the distinct
    predicted strings) of every layer and position; the selected ``position`` (offered by its
    ``position_labels``) and ``top_k``."""

    _esm = traitlets.Unicode(module_source("logit_lens")).tag(sync=True)
    layer_labels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    vocab = traitlets.List(traitlets.Unicode()).tag(sync=True)
    n_ranks = traitlets.Int().tag(sync=True)
    probs = traitlets.Bytes().tag(sync=True)
    token_ids = traitlets.Bytes().tag(sync=True)
    position_labels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    position = traitlets.Int(0).tag(sync=True)
    top_k = traitlets.Int(1).tag(sync=True)


def vocabulary_of(
    top_tokens: Sequence[Sequence[Sequence[str]]],
) -> tuple[list[str], list[list[list[int]]]]:
    """The distinct strings of ``top_tokens`` (first-seen order) and ``top_tokens`` as indices."""
    index: dict[str, int] = {}
    ids = [[[index.setdefault(t, len(index)) for t in cell] for cell in row] for row in top_tokens]
    return list(index), ids


class LogitLensTable(Viewer):
    """Top-k predictions of every layer at a selected position, plus the top-1 grid.

    ``probs[layer, pos, rank]`` and ``top_tokens[layer][pos][rank]`` hold the ranked predictions
    (most probable first). Selectors: ``position`` (which input token's next-token prediction)
    and ``top_k``; in the browser, clicking a grid column also selects its position.
    :meth:`from_bridge` builds it with ``qlens.analysis.logit_lens``.
    """

    def __init__(
        self,
        probs: Float[Tensor, "layer pos rank"],
        top_tokens: Sequence[Sequence[Sequence[str]]],
        layer_labels: Sequence[str],
        tokens: Sequence[str],
        *,
        top_k: int = 5,
    ) -> None:
        n_layers, n_pos, n_ranks = probs.shape
        if len(layer_labels) != n_layers:
            raise ValueError(f"got {len(layer_labels)} layer labels for {n_layers} layers of probs")
        if len(tokens) != n_pos:
            raise ValueError(f"got {len(tokens)} token labels for {n_pos} positions of probs")
        if not _nested_shape_is(top_tokens, (n_layers, n_pos, n_ranks)):
            raise ValueError(
                f"top_tokens must be nested [layer][pos][rank] like probs {tuple(probs.shape)}"
            )
        if not 1 <= top_k <= n_ranks:
            raise ValueError(f"top_k must be in [1, {n_ranks}], got {top_k}")
        self.probs = probs.detach().float().cpu()
        self.top_tokens = [[list(cell) for cell in row] for row in top_tokens]
        self.layer_labels = list(layer_labels)
        self.tokens = list(tokens)
        labels = position_labels(self.tokens)
        self.position = widgets.Dropdown(
            options=[(label, i) for i, label in enumerate(labels)],
            value=n_pos - 1,
            description="position",
        )
        self.top_k = widgets.IntSlider(value=top_k, min=1, max=n_ranks, description="top k")
        vocab, ids = vocabulary_of(self.top_tokens)
        view = LogitLensView(
            layer_labels=self.layer_labels,
            tokens=[visible_token(t) for t in self.tokens],
            vocab=[visible_token(t) for t in vocab],
            n_ranks=n_ranks,
            position_labels=labels,
            probs=float16_bytes(self.probs),
            token_ids=uint32_bytes(torch.tensor(ids, dtype=torch.int64).reshape(probs.shape)),
        )
        self._finish(view, [(self.position, "index", "position"), (self.top_k, "value", "top_k")])

    @classmethod
    def from_bridge(
        cls, bridge: Any, input: str | Tensor, *, top_k: int = 5, dequantize: bool = False
    ) -> LogitLensTable:  # noqa: A002
        """Run ``bridge`` on one sequence and apply ``qlens.analysis.logit_lens`` at every
        position (``dequantize=True`` reads a quantized unembedding explicitly)."""
        from qlens.analysis import logit_lens

        tokens = bridge.to_tokens(input) if isinstance(input, str) else input
        tokens = tokens[None] if tokens.ndim == 1 else tokens
        if tokens.ndim != 2 or tokens.shape[0] != 1:
            raise ValueError(f"the logit lens takes one sequence, got tokens {tuple(tokens.shape)}")
        _, cache = bridge.run_with_cache(
            tokens, names_filter=lambda n: n.endswith(("hook_resid_pre", "hook_resid_post"))
        )
        cache.remove_batch_dim()
        n_pos, k = tokens.shape[1], min(MAX_TOP_K, bridge.cfg.d_vocab)
        lenses = [
            logit_lens(bridge, cache, pos=p, k=k, dequantize=dequantize) for p in range(n_pos)
        ]
        probs = torch.stack([lens.probs for lens in lenses], dim=1)  # [layer pos rank]
        ids = torch.stack([lens.token_ids for lens in lenses], dim=1).tolist()
        text = {i: token_text(bridge.tokenizer, i) for i in {*tokens[0].tolist(), *_flat(ids)}}
        top_tokens = [[[text[i] for i in cell] for cell in row] for row in ids]
        inputs = [text[int(i)] for i in tokens[0]]
        return cls(probs, top_tokens, lenses[0].labels, inputs, top_k=top_k)

    @property
    def displayed(self) -> list[tuple[str, list[tuple[str, float]]]]:
        """The table currently shown: per layer, its top-k ``(token, probability)``."""
        pos, k = self.position.value, self.top_k.value
        return [
            (
                label,
                [(self.top_tokens[row][pos][r], float(self.probs[row, pos, r])) for r in range(k)],
            )
            for row, label in enumerate(self.layer_labels)
        ]

    def _render_html(self) -> str:
        pos = self.position.value
        return static.logit_lens(
            self.probs[..., 0],
            [[cell[0] for cell in row] for row in self.top_tokens],
            self.layer_labels,
            self.tokens,
            self.displayed,
            f"logit lens at position {pos} ({self.tokens[pos]!r})",
            selected=pos,
        )
