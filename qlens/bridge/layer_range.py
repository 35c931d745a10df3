"""Forwards over part of the layers: ``stop_at_layer`` and ``start_at_layer``.

A stop raises :class:`StopForward` (carrying the residual) from a pre-hook on the first layer
not to run; a start makes the layers before it pass their input on and hands its residual to
the first layer that runs. Layers are positions in ``[0, n_layers]``; ``n_layers`` is the final
norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge.names import layer_of


class StopForward(Exception):  # noqa: N818
    """Raised before the first layer a stopped forward does not run."""

    def __init__(self, residual: Tensor) -> None:
        self.residual = residual


@dataclasses.dataclass(frozen=True)
class Start:
    """A forward from layer ``layer`` on ``residual``."""

    layer: int
    residual: Tensor


def layer_position(layer: int, n_layers: int, what: str) -> int:
    """``layer`` (``what``: ``stop_at_layer`` or ``start_at_layer``, in [-n_layers, n_layers],
    negative counting from the end) as a position in [0, n_layers]."""
    if not -n_layers <= layer <= n_layers:
        raise ValueError(f"{what} must be in [{-n_layers}, {n_layers}], got {layer}")
    return layer + n_layers if layer < 0 else layer


def fires_before(name: str, stop_at_layer: int | None) -> bool:
    """Whether ``name`` fires in a forward stopped before layer ``stop_at_layer``."""
    if stop_at_layer is None:
        return True
    layer = layer_of(name)
    return layer < stop_at_layer if layer is not None else not name.startswith("ln_final.")


def fires_from(name: str, start_at_layer: int | None) -> bool:
    """Whether ``name`` fires in a forward started at layer ``start_at_layer``."""
    if start_at_layer is None:
        return True
    layer = layer_of(name)
    return layer >= start_at_layer if layer is not None else name.startswith("ln_final.")


def check_fireable(
    active: set[str], stop_at_layer: int | None, start_at_layer: int | None = None
) -> None:
    """Refuse, by name, an active hook the forward's layer range does not reach."""
    for name in sorted(active):
        if not fires_before(name, stop_at_layer):
            raise ValueError(
                f"hook {name!r} cannot fire with stop_at_layer={stop_at_layer}: the forward "
                f"stops before it. Remove the hook or raise stop_at_layer."
            )
        if not fires_from(name, start_at_layer):
            raise ValueError(
                f"hook {name!r} cannot fire with start_at_layer={start_at_layer}: the "
                "forward starts after it. Remove the hook or lower start_at_layer."
            )


def _layer_input(*args: Any, **kwargs: Any) -> Any:
    """The hidden states a decoder layer (or the final norm) is called with; as a skipped
    layer's forward, its input passed on unchanged (what HF layers return)."""
    return args[0] if args else kwargs["hidden_states"]


class Skipping:
    """Handle of a start: removing it restores the skipped layers' forwards and the hook."""

    def __init__(self, handle: RemovableHandle, skipped: list[nn.Module]) -> None:
        self.handle, self.skipped = handle, skipped
        self.own = [m.__dict__.get("forward") for m in skipped]  # wrappers set on instances
        for module in skipped:
            module.forward = _layer_input  # type: ignore[method-assign]

    def remove(self) -> None:
        self.handle.remove()
        for module, own in zip(self.skipped, self.own, strict=True):
            if own is None:
                del module.forward
            else:
                module.forward = own


def start_hook(target: nn.Module, skipped: list[nn.Module], start: Start) -> Skipping:
    """Skip the ``skipped`` layers (each passes its input on, computing nothing) and hand
    ``start.residual`` to ``target``, the first that runs (a layer or the final norm)."""

    def enter(
        _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (start.residual, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": start.residual}

    handle = target.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    return Skipping(handle, skipped)


def stop_hook(target: nn.Module) -> RemovableHandle:
    """Raise :class:`StopForward` with ``target``'s input (the residual) before it runs."""

    def stop(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise StopForward(_layer_input(*args, **kwargs))

    return target.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
