"""Labeled: an analysis result tensor with the name and the labels of each axis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class Labeled:
    """``values`` with one name per axis in ``axes`` and, per axis, optional string labels."""

    values: Tensor
    axes: tuple[str, ...]
    labels: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.axes) != self.values.ndim:
            raise ValueError(
                f"{len(self.axes)} axis names {self.axes} for a tensor of shape "
                f"{list(self.values.shape)}: give one name per dimension"
            )
        for axis, names in self.labels.items():
            if axis not in self.axes:
                raise ValueError(f"labels given for unknown axis {axis!r}; axes are {self.axes}")
            size = self.values.shape[self.axes.index(axis)]
            if len(names) != size:
                raise ValueError(f"axis {axis!r} has size {size} but {len(names)} labels")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: values as nested lists, axes and labels."""
        return {
            "values": self.values.detach().cpu().tolist(),
            "axes": list(self.axes),
            "labels": {k: list(v) for k, v in self.labels.items()},
        }

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.values.shape, strict=True))
        return f"Labeled({dims})"
