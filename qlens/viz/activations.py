"""Activation heatmap: one neuron (or a direction) of any hook, over the tokens of a sequence."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ipywidgets as widgets
from jaxtyping import Float
from torch import Tensor

from qlens.bridge.cache import ActivationCache
from qlens.viz import static
from qlens.viz.viewer import Viewer

NEURON = "neuron"
# Hooks whose second axis is not the token position.
_NOT_PER_TOKEN = ("hook_pattern", "hook_attn_scores")


def per_token_features(
    activations: ActivationCache | Mapping[str, Tensor],
    n_pos: int,
    batch: int = 0,
    has_batch_dim: bool = True,
) -> dict[str, Float[Tensor, "pos feature"]]:
    """Each cached activation of one sequence as ``[pos feature]`` (trailing dims flattened).

    Keeps the hooks whose position axis has ``n_pos`` entries; attention patterns and scores
    are left out (their axes are heads, not tokens).
    """
    features: dict[str, Tensor] = {}
    for name in activations:
        value = activations[name]
        if name.endswith(_NOT_PER_TOKEN) or value.ndim < (3 if has_batch_dim else 2):
            continue
        if has_batch_dim:
            if not 0 <= batch < value.shape[0]:
                raise ValueError(
                    f"batch index {batch} is out of range for {name} {tuple(value.shape)}"
                )
            value = value[batch]
        if value.shape[0] != n_pos:
            continue
        features[name] = value.detach().float().cpu().reshape(n_pos, -1)
    if not features:
        raise ValueError(
            f"no cached activation has a position axis of {n_pos} tokens; pass the cache of a "
            "run on the same input as the token labels"
        )
    return features


class ActivationHeatmap(Viewer):
    """Per-token values of one hook's neuron or of its projection on a named direction.

    Selectors: ``hook`` (any per-token hook in the cache), ``feature`` ("neuron" or a direction
    name) and ``neuron`` (index into the hook's flattened trailing dims, e.g. ``head * d_head + i``
    for ``attn.hook_z``). ``activations`` is an ``ActivationCache`` or a dict of batched tensors.
    """

    def __init__(
        self,
        activations: ActivationCache | Mapping[str, Tensor],
        tokens: Sequence[str],
        *,
        directions: Mapping[str, Float[Tensor, " d"]] | None = None,
        hook: str | None = None,
        batch: int = 0,
    ) -> None:
        self.tokens = list(tokens)
        has_batch_dim = bool(getattr(activations, "has_batch_dim", True))
        self.features = per_token_features(activations, len(self.tokens), batch, has_batch_dim)
        self.directions = {
            k: v.detach().float().cpu().reshape(-1) for k, v in (directions or {}).items()
        }
        if NEURON in self.directions:
            raise ValueError(f"{NEURON!r} is reserved for single neurons; rename that direction")
        names = list(self.features)
        if hook is not None and hook not in self.features:
            raise ValueError(
                f"hook {hook!r} is not a per-token activation of this cache; choose one of "
                f"{names[:5]}{'...' if len(names) > 5 else ''}"
            )
        self.hook = widgets.Dropdown(options=names, value=hook or names[0], description="hook")
        self.feature = widgets.Dropdown(
            options=[NEURON, *self.directions], value=NEURON, description="feature"
        )
        self.neuron = widgets.BoundedIntText(
            value=0, min=0, max=self._width() - 1, description="neuron"
        )
        self.hook.observe(self._on_hook_change, names="value")
        self._finish([self.hook, self.feature, self.neuron])

    def _width(self) -> int:
        return int(self.features[self.hook.value].shape[1])

    def _on_hook_change(self, _change: dict) -> None:
        self.neuron.max = self._width() - 1

    @property
    def displayed(self) -> Float[Tensor, " pos"]:
        """The per-token values currently shown."""
        values = self.features[self.hook.value]
        if self.feature.value == NEURON:
            return values[:, self.neuron.value]
        direction = self.directions[self.feature.value]
        if direction.numel() != values.shape[1]:
            raise ValueError(
                f"direction {self.feature.value!r} has {direction.numel()} entries but "
                f"{self.hook.value} has {values.shape[1]} features per token; pick a hook of that width"
            )
        return values @ direction

    def _render_html(self) -> str:
        what = f"neuron {self.neuron.value}" if self.feature.value == NEURON else self.feature.value
        values = self.displayed
        return static.activation_heatmap(
            values[None], self.tokens, [what], f"{self.hook.value}: {what}"
        )
