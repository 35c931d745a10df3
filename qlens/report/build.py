"""A report is a list of sections, each computed from one shared run of the model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from qlens.bridge import ActivationCache, Bridge


@dataclass
class ReportContext:
    """Everything a section may read: the bridge, the prompt and the cached run."""

    bridge: Bridge
    model_label: str
    prompt: str
    tokens: Int[Tensor, "batch pos"]
    logits: Float[Tensor, "batch pos vocab"]
    cache: ActivationCache
    top_k: int


@dataclass
class Section:
    """One part of a report: a JSON-ready `data` dict and its human-readable `text`."""

    key: str
    title: str
    data: Any
    text: str


SectionBuilder = Callable[[ReportContext], Section]


@dataclass
class Report:
    sections: list[Section] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {section.key: section.data for section in self.sections}

    def to_text(self) -> str:
        return "\n\n".join(f"== {s.title} ==\n{s.text}" for s in self.sections) + "\n"

    def write(self, out_dir: str | Path) -> Path:
        """Write `report.json` into `out_dir` (created if needed); returns its path."""
        path = Path(out_dir) / "report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def default_sections() -> list[SectionBuilder]:
    from qlens.report import capture, predictions, residual, run_info

    return [run_info.section, predictions.section, capture.section, residual.section]


def build_report(
    bridge: Bridge,
    prompt: str,
    *,
    top_k: int = 10,
    model_label: str = "",
    sections: list[SectionBuilder] | None = None,
) -> Report:
    """Run `prompt` once with every hook point cached, then build each section from that run."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}.")
    tokens = bridge.to_tokens(prompt)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens, return_cache_object=True)
    assert isinstance(cache, ActivationCache)
    context = ReportContext(bridge, model_label, prompt, tokens, logits, cache, top_k)
    return Report([build(context) for build in (sections or default_sections())])
