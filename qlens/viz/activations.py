"""Activation heatmap: one neuron (or a direction) of any hook, over the tokens of a sequence."""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence

import ipywidgets as widgets
import torch
import traitlets
from jaxtyping import Float
from torch import Tensor

from qlens.bridge.cache import ActivationCache
from qlens.viz import static
from qlens.viz.arrays import float16_bytes
from qlens.viz.browser import BrowserView, module_source
from qlens.viz.labels import visible_token
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


_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
# The group of hooks outside the blocks (embeddings, final norm).
MODEL = "model"


def hook_groups(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """Hook names grouped by layer (``"0"``, ``"1"``, ... and ``"model"`` for the rest) then
    kind (the name within its block, e.g. ``attn.hook_z``), in the order given."""
    groups: dict[str, dict[str, str]] = {}
    for name in names:
        match = _BLOCK.fullmatch(name)
        layer, kind = (match.group(1), match.group(2)) if match else (MODEL, name)
        groups.setdefault(layer, {})[kind] = name
    return groups


class ActivationView(BrowserView):
    """The ``[pos feature]`` values (float16) of hook ``shown_hook`` and each direction's
    projection (float32 ``[direction pos]``, with an explanation where the widths differ); the
    selected ``hook`` (from ``hook_groups``: ``[layer, [[kind, name], ...]]``; a new one brings
    its values from the kernel), ``feature`` (0 for a neuron, else 1 + the direction's index)
    and ``neuron``."""

    _esm = traitlets.Unicode(module_source("activations")).tag(sync=True)
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    hook_groups: traitlets.List[list] = traitlets.List().tag(sync=True)
    hook = traitlets.Unicode().tag(sync=True)
    shown_hook = traitlets.Unicode().tag(sync=True)
    n_features = traitlets.Int(1).tag(sync=True)
    values = traitlets.Bytes().tag(sync=True)
    directions = traitlets.List(traitlets.Unicode()).tag(sync=True)
    projections = traitlets.Bytes().tag(sync=True)
    direction_errors = traitlets.List(traitlets.Unicode()).tag(sync=True)
    feature = traitlets.Int(0).tag(sync=True)
    neuron = traitlets.Int(0).tag(sync=True)


def _width_error(direction: str, width: int, hook: str, features: int) -> str:
    return (
        f"direction {direction!r} has {width} entries but {hook} has {features} features per "
        "token; pick a hook of that width"
    )


class ActivationHeatmap(Viewer):
    """Per-token values of one hook's neuron or of its projection on a named direction.

    Selectors: the hook, picked by ``layer`` then ``kind`` (``hook`` holds the full name),
    ``feature`` ("neuron" or a direction name; shown only when directions are given) and
    ``neuron`` (index into the hook's flattened trailing dims, e.g. ``head * d_head + i`` for
    ``attn.hook_z``; disabled while a direction is shown). Neuron and direction changes redraw
    in the browser; a new hook sends that hook's values from the kernel. ``activations`` is an
    ``ActivationCache`` or a dict of batched tensors. The selectors are ``ipywidgets`` controls
    holding the selection in the kernel (``hook``, ``hook_layer`` and ``hook_kind`` are
    ``Dropdown``s, ``neuron`` a ``BoundedIntText``); the browser draws its own.
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
        self.groups = hook_groups(names)
        self.hook = widgets.Dropdown(options=names, value=hook or names[0], description="hook")
        layer, kind = self._group_of(self.hook.value)
        self.hook_layer = widgets.Dropdown(
            options=list(self.groups), value=layer, description="layer"
        )
        self.hook_kind = widgets.Dropdown(
            options=list(self.groups[layer]), value=kind, description="kind"
        )
        self.feature = widgets.Dropdown(
            options=[NEURON, *self.directions], value=NEURON, description="feature"
        )
        self.neuron = widgets.BoundedIntText(
            value=0, min=0, max=self._width() - 1, description="neuron"
        )
        view = ActivationView(
            tokens=[visible_token(t) for t in self.tokens],
            directions=list(self.directions),
            hook_groups=[
                [layer, [[kind, name] for kind, name in kinds.items()]]
                for layer, kinds in self.groups.items()
            ],
        )
        self._send_hook(view)
        self.hook.observe(self._on_hook_change, names="value")
        self.hook_layer.observe(self._on_group_change, names="value")
        self.hook_kind.observe(self._on_group_change, names="value")
        self.feature.observe(self._on_feature_change, names="value")
        self._finish(
            view,
            [
                (self.hook, "value", "hook"),
                (self.feature, "index", "feature"),
                (self.neuron, "value", "neuron"),
            ],
        )

    def _group_of(self, name: str) -> tuple[str, str]:
        match = _BLOCK.fullmatch(name)
        return (match.group(1), match.group(2)) if match else (MODEL, name)

    def _width(self) -> int:
        return int(self.features[self.hook.value].shape[1])

    def _send_hook(self, view: ActivationView) -> None:
        """Send the selected hook's values and direction projections to the browser."""
        name, values = self.hook.value, self.features[self.hook.value]
        projections, errors = [], []
        for direction, vector in self.directions.items():
            if vector.numel() == values.shape[1]:
                projections.append(values @ vector)
                errors.append("")
            else:
                projections.append(torch.full((values.shape[0],), float("nan")))
                errors.append(_width_error(direction, vector.numel(), name, values.shape[1]))
        stacked = torch.stack(projections) if projections else torch.zeros(0)
        with view.hold_sync():
            view.hook = view.shown_hook = name
            view.n_features = values.shape[1]
            view.values = float16_bytes(values)
            view.projections = stacked.numpy().astype("<f4").tobytes()
            view.direction_errors = errors

    def _on_hook_change(self, _change: dict) -> None:
        self.neuron.max = self._width() - 1
        layer, kind = self._group_of(self.hook.value)
        if (self.hook_layer.value, self.hook_kind.value) != (layer, kind):
            self.hook_layer.value = layer
            self.hook_kind.options = list(self.groups[layer])
            self.hook_kind.value = kind
        self._send_hook(self.view)

    def _on_group_change(self, _change: dict) -> None:
        kinds = self.groups[self.hook_layer.value]
        if list(self.hook_kind.options) != list(kinds):
            current = self.hook_kind.value
            self.hook_kind.options = list(kinds)
            self.hook_kind.value = current if current in kinds else next(iter(kinds))
        name = kinds.get(self.hook_kind.value)
        if name is not None and name != self.hook.value:
            self.hook.value = name

    def _on_feature_change(self, _change: dict) -> None:
        self.neuron.disabled = self.feature.value != NEURON

    @property
    def view(self) -> ActivationView:
        """The drawing area (an anywidget holding the selected hook's values)."""
        return self._browser_view  # type: ignore[return-value]

    @property
    def displayed(self) -> Float[Tensor, " pos"]:
        """The per-token values currently shown."""
        values = self.features[self.hook.value]
        if self.feature.value == NEURON:
            return values[:, self.neuron.value]
        direction = self.directions[self.feature.value]
        if direction.numel() != values.shape[1]:
            raise ValueError(
                _width_error(
                    self.feature.value, direction.numel(), self.hook.value, values.shape[1]
                )
            )
        return values @ direction

    def _render_html(self) -> str:
        what = f"neuron {self.neuron.value}" if self.feature.value == NEURON else self.feature.value
        try:
            values = self.displayed
        except ValueError as error:
            return f"<pre>{html.escape(str(error))}</pre>"
        return static.activation_heatmap(
            values[None], self.tokens, [what], f"{self.hook.value}: {what}"
        )
