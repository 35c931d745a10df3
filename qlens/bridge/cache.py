"""ActivationCache: activations by canonical name, with TransformerLens-style shorthands."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator

import torch
from jaxtyping import Float
from torch import Tensor

from qlens.formatting import format_bytes


class ActivationCache:
    """Cached activations. ``cache[name]``, ``cache["pattern", 3]``, ``cache["scale", 3, "ln2"]``.

    ``final_norm`` (the model's final norm module) enables ``accumulated_resid(apply_ln=True)``.
    """

    def __init__(
        self,
        cache: dict[str, Tensor],
        n_layers: int,
        final_norm: Callable[[Tensor], Tensor] | None = None,
        has_batch_dim: bool = True,
    ) -> None:
        self.cache = dict(cache)
        self.n_layers = n_layers
        self.final_norm = final_norm
        self.has_batch_dim = has_batch_dim

    # -- access -----------------------------------------------------------------------------
    def _full_name(self, key: str | tuple) -> str:
        if isinstance(key, str):
            if key in self.cache:
                return key
            if "." in key:
                raise self._missing(key)
            key = (key,)  # a shorthand without a layer: "embed", "normalized"
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise TypeError(
                f"cache keys are names or (short_name, layer[, sub]) tuples, got {key!r}"
            )
        short = key[0].removeprefix("hook_")
        layer = key[1] if len(key) > 1 else None
        sub = key[2] if len(key) > 2 else None
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

    def remove_batch_dim(self) -> ActivationCache:
        """Drop the batch dimension (in place) of a batch-1 cache; returns self."""
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
    def stack_activation(self, name: str) -> Tensor:
        """Stack one activation over layers: ``stack_activation("resid_post")`` -> [layer ...]."""
        return _stack_on_one_device([self[name, layer] for layer in range(self.n_layers)], name)

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        return_labels: bool = False,
    ) -> Float[Tensor, "component ..."] | tuple[Float[Tensor, "component ..."], list[str]]:
        """The residual stream before each of the first ``layer`` layers (None: all of them, plus
        the final residual), optionally with each resid_mid; ``apply_ln`` applies the model's
        final norm to every component (a logit-lens view)."""
        if layer is None:
            layer = self.n_layers
        if not 0 <= layer <= self.n_layers:
            raise ValueError(f"layer must be in [0, {self.n_layers}], got {layer}")
        parts, labels = [], []
        for i in range(layer):
            parts.append(self["resid_pre", i])
            labels.append(f"{i}_pre")
            if incl_mid:
                parts.append(self["resid_mid", i])
                labels.append(f"{i}_mid")
        if layer == self.n_layers:
            parts.append(self["resid_post", self.n_layers - 1])
            labels.append("final_post")
        else:
            parts.append(self["resid_pre", layer])
            labels.append(f"{layer}_pre")
        stack = _stack_on_one_device(parts, "the residual stream")
        if apply_ln:
            if self.final_norm is None:
                raise ValueError("apply_ln=True needs the model's final norm; this cache has none")
            stack = self.final_norm(stack)
        return (stack, labels) if return_labels else stack

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
