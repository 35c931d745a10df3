"""Everything of a payload that is not a tensor, as data: rebuild a payload from its tensors."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qlens.quant.formats import QuantFormat
from qlens.quant.payload import QuantPayload

OPTIONAL_TENSORS = ("scales", "zeros", "global_scale")


@dataclass(frozen=True)
class PayloadSpec:
    """A payload's format, logical shape and layout, plus which optional tensors it holds."""

    format: QuantFormat
    shape: tuple[int, ...]
    layout: dict[str, Any] = field(default_factory=dict)
    present: tuple[str, ...] = ()  # names among scales, zeros, global_scale
    extras: tuple[str, ...] = ()

    @classmethod
    def of(cls, payload: QuantPayload) -> PayloadSpec:
        return cls(
            format=payload.format,
            shape=tuple(int(s) for s in payload.shape),
            layout=dict(payload.layout),
            present=tuple(n for n in OPTIONAL_TENSORS if getattr(payload, n) is not None),
            extras=tuple(payload.extras),
        )

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The payload's tensors in the order ``build`` takes them (``QuantPayload.tensors``)."""
        return ("data", *self.present, *(f"extra.{k}" for k in self.extras))

    def build(self, tensors: Sequence[torch.Tensor]) -> QuantPayload:
        """The payload of these tensors, given in ``tensor_names`` order."""
        named = dict(zip(self.tensor_names, tensors, strict=True))
        return QuantPayload(
            format=self.format,
            data=named["data"],
            shape=self.shape,
            layout=dict(self.layout),
            extras={k: named[f"extra.{k}"] for k in self.extras},
            **{n: named[n] for n in self.present},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": asdict(self.format),
            "shape": list(self.shape),
            "layout": self.layout,
            "present": list(self.present),
            "extras": list(self.extras),
        }

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> PayloadSpec:
        fmt = dict(entry["format"])
        fmt["block"] = tuple(fmt["block"])
        return cls(
            format=QuantFormat(**fmt),
            shape=tuple(int(s) for s in entry["shape"]),
            layout=dict(entry["layout"]),
            present=tuple(entry["present"]),
            extras=tuple(entry["extras"]),
        )

    @functools.cached_property
    def key(self) -> str:
        """The spec as one JSON string (what the ``qlens::`` ops take)."""
        return _compact_json(self.to_json())


@functools.lru_cache(maxsize=1024)
def spec_from_key(key: str) -> PayloadSpec:
    """The spec whose ``key`` is ``key`` (parsed once per key)."""
    return PayloadSpec.from_json(json.loads(key))


def joined_keys(keys: Sequence[str]) -> str:
    """Several spec keys as one string: a JSON array of the specs. Nothing in it needs a
    backslash (a key has none), so the string survives inductor's generated code verbatim,
    where it is written inside other string literals."""
    if any("\\" in key for key in keys):
        raise ValueError(f"spec keys with a backslash cannot be joined: {list(keys)}")
    return "[" + ",".join(keys) + "]"


@functools.lru_cache(maxsize=256)
def split_keys(joined: str) -> tuple[str, ...]:
    """The spec keys that :func:`joined_keys` joined, in order."""
    return tuple(_compact_json(entry) for entry in json.loads(joined))


def _compact_json(entry: Any) -> str:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"))
