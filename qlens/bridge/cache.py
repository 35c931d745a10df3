"""ActivationCache: activations by canonical name, with TransformerLens' shorthands and its
analysis methods (``qlens.bridge.cache_methods``)."""

from __future__ import annotations

import difflib
import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from qlens.analysis.slicing import Slice, SliceInput
from qlens.bridge.cache_methods import CacheAnalysisMethods
from qlens.formatting import format_bytes

logger = logging.getLogger(__name__)

# TransformerLens' shorthands (transformer_lens.utils.get_act_name)
_NAME_ALIASES = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_mid": "mid",
    "mlp_post": "post",
}
_SUB_ALIASES = {"a": "attn", "m": "mlp", "b": None, "block": None, "blocks": None, "": None}
_SUB_ALIASES["attention"] = "attn"


class ActivationCache(CacheAnalysisMethods):
    """Cached activations: ``cache[name]``, ``cache["pattern", 3]``, ``cache["scale", 3, "ln2"]``,
    ``cache["resid_pre", -1]``, ``cache["k6"]``, and TransformerLens' analysis methods
    (``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``logit_attrs``, ...),
    which need the ``bridge`` the activations come from.
    """

    def __init__(
        self,
        cache: dict[str, Tensor],
        n_layers: int,
        has_batch_dim: bool = True,
        bridge: Any = None,
    ) -> None:
        self.cache = dict(cache)
        self.n_layers = n_layers
        self.has_batch_dim = has_batch_dim
        self.bridge = bridge

    @property
    def model(self) -> Any:
        """The bridge the activations come from (TransformerLens' ``cache.model``)."""
        return self.bridge

    @property
    def cache_dict(self) -> dict[str, Tensor]:
        """The activations by full hook name (TransformerLens' ``cache.cache_dict``)."""
        return self.cache

    @property
    def has_embed(self) -> bool:
        return "hook_embed" in self.cache

    @property
    def has_pos_embed(self) -> bool:
        return "hook_pos_embed" in self.cache

    # -- access -----------------------------------------------------------------------------
    def _full_name(self, key: str | tuple) -> str:
        if isinstance(key, str):
            if key in self.cache:
                return key
            if "." in key:
                raise self._missing(key)
            key = _split_compact(key)  # "embed", "normalized", "k6", "scale4ln1"
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise TypeError(
                f"cache keys are names or (short_name, layer[, sub]) tuples, got {key!r}"
            )
        short = key[0].removeprefix("hook_")
        short = _NAME_ALIASES.get(short, short)
        layer = key[1] if len(key) > 1 else None
        sub = key[2] if len(key) > 2 else None
        sub = _SUB_ALIASES.get(sub, sub) if isinstance(sub, str) else sub
        if layer is not None and layer < 0:
            layer += self.n_layers
        if layer is None:
            pattern = (
                rf"(?:{re.escape(sub)}\.)?hook_{re.escape(short)}"
                if sub
                else rf"(?:ln_final\.)?hook_{re.escape(short)}"
            )
        else:
            middle = rf"{re.escape(sub)}\." if sub else r"(?:[a-z0-9_]+\.)?"
            pattern = rf"blocks\.{layer}\.{middle}hook_{re.escape(short)}"
        matches = [n for n in self.cache if re.fullmatch(pattern, n)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise KeyError(
                f"{key!r} is ambiguous between {', '.join(matches)}; add the sub-module, "
                f"e.g. {(key[0], layer, matches[0].split('.')[-2])!r}"
            )
        raise self._missing(str(key))

    def _missing(self, key: str) -> KeyError:
        if not self.cache:
            return KeyError(f"{key!r} is not in the cache: the cache is empty")
        close = difflib.get_close_matches(key, list(self.cache), n=5, cutoff=0.5)
        hint = f"closest present: {', '.join(close)}. " if close else ""
        shown = ", ".join(list(self.cache)[:20])
        more = f", ... ({len(self.cache)} names)" if len(self.cache) > 20 else ""
        return KeyError(f"{key!r} is not in the cache. {hint}Present: {shown}{more}")

    def __getitem__(self, key: str | tuple) -> Tensor:
        return self.cache[self._full_name(key)]

    def __contains__(self, key: object) -> bool:
        try:
            self._full_name(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __len__(self) -> int:
        return len(self.cache)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache)

    def keys(self):  # noqa: ANN201
        return self.cache.keys()

    def values(self):  # noqa: ANN201
        return self.cache.values()

    def items(self):  # noqa: ANN201
        return self.cache.items()

    # -- transforms -------------------------------------------------------------------------
    def to(self, device: str | torch.device) -> ActivationCache:
        """Move every tensor to ``device`` (in place); returns self."""
        self.cache = {k: v.to(device) for k, v in self.cache.items()}
        return self

    def toggle_autodiff(self, mode: bool = False) -> None:
        """``torch.set_grad_enabled(mode)``: switches autograd globally, not just for the cache
        (``torch.inference_mode()`` as a context manager is the local alternative)."""
        logger.warning("Changed the global state, set autodiff to %s", mode)
        torch.set_grad_enabled(mode)

    def apply_slice_to_batch_dim(self, batch_slice: SliceInput) -> ActivationCache:
        """A new cache holding the batch rows ``batch_slice`` selects (an int drops the batch
        dimension); entries whose leading dim is not the batch (broadcast ones) are kept."""
        rows = Slice(batch_slice)
        if not self.has_batch_dim and rows.mode != "identity":
            raise ValueError("cannot slice the batch dimension: this cache has none")
        batch = self._batch_size()
        broadcast = Slice(0 if rows.mode == "int" else None)  # [1 ...] entries, e.g. pos_embed
        sliced = {
            name: (rows if value.ndim and value.shape[0] == batch else broadcast).apply(value, 0)
            for name, value in self.cache.items()
        }
        return ActivationCache(
            sliced, self.n_layers, self.has_batch_dim and rows.mode != "int", self.bridge
        )

    def _batch_size(self) -> int:
        counts = Counter(v.shape[0] for v in self.cache.values() if v.ndim)
        return counts.most_common(1)[0][0] if counts else 1

    def remove_batch_dim(self, batch_size: int | None = None) -> ActivationCache:
        """Drop the batch dimension (in place) of a batch-1 cache; returns self."""
        if batch_size not in (None, 1):
            raise ValueError(
                f"cannot remove the batch dimension of a batch of {batch_size}: only a batch of "
                "one sequence can drop it; use apply_slice_to_batch_dim(i) to take sequence i"
            )
        if not self.has_batch_dim:
            return self
        for name, value in self.cache.items():
            if value.shape[0] != 1:
                raise ValueError(
                    f"cannot remove the batch dimension: {name} has batch size {value.shape[0]}; "
                    "only a batch of one sequence can drop it"
                )
        self.cache = {k: v[0] for k, v in self.cache.items()}
        self.has_batch_dim = False
        return self

    # -- stacks -----------------------------------------------------------------------------
    def stack_activation(
        self, activation_name: str, layer: int | None = -1, sublayer_type: str | None = None
    ) -> Tensor:
        """One activation of each layer before ``layer`` (None / -1: all) stacked:
        ``stack_activation("resid_post")`` -> ``[layer ...]``."""
        layers = self._final_layer(layer)
        return self._stack(
            [self[activation_name, i, sublayer_type] for i in range(layers)], activation_name
        )

    def _stack(self, tensors: list[Tensor], what: str) -> Tensor:
        return _stack_on_one_device(tensors, what)

    # -- display ----------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.cache.values())

    def __repr__(self) -> str:
        lines = [f"ActivationCache({len(self.cache)} tensors, {format_bytes(self.total_bytes)})"]
        for name, value in self.cache.items():
            lines.append(
                f"  {name}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
            )
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from qlens.rich_repr import render_html

        return render_html("cache", self)


def _stack_on_one_device(tensors: list[Tensor], what: str) -> Tensor:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"cannot stack {what}: its activations are on several devices "
            f"({', '.join(sorted(str(d) for d in devices))}); gather them on one device with "
            "run_with_cache(..., device=...) or cache.to(device)"
        )
    return torch.stack(tensors)


def _split_compact(name: str) -> tuple[Any, ...]:
    """TransformerLens' compact names: ``"k6"`` -> ``("k", 6)``, ``"scale4ln1"`` ->
    ``("scale", 4, "ln1")``; anything else is a name without a layer."""
    match = re.fullmatch(r"([a-z_]+?)(\d+)([a-z]\w*)?", name)
    if match is None:
        return (name,)
    short, layer, sub = match.groups()
    return (short, int(layer), sub)
