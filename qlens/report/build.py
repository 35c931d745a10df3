"""A report is a list of sections, each computed from one shared run of the model and its
quantized versions."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from qlens.bridge import ActivationCache, Bridge
from qlens.report.variants import Variant, base_variant, check_schemes, quantized_variant


@dataclass
class ReportContext:
    """Everything a section may read: the loaded model's bridge and cached run on the prompt,
    and every variant (``variants[0]`` is the loaded model, then one per quantization scheme)."""

    bridge: Bridge
    model_label: str
    prompt: str
    tokens: Int[Tensor, "batch pos"]
    logits: Float[Tensor, "batch pos vocab"]
    cache: ActivationCache
    top_k: int
    variants: list[Variant] = field(default_factory=list)

    @property
    def reference(self) -> Variant | None:
        """The float reference, or None when the loaded model is already quantized."""
        first = self.variants[0] if self.variants else None
        return first if first is not None and first.role == "reference" else None

    @property
    def quantized(self) -> list[Variant]:
        """The copies quantized by qlens, in the order asked for."""
        return [v for v in self.variants if v.role == "quantized"]


@dataclass
class Section:
    """One part of a report: JSON-ready ``data``, its human-readable ``text``, optionally an HTML
    rendering (``html``; the text is shown preformatted otherwise) and figures as PNG bytes by
    name."""

    key: str
    title: str
    data: Any
    text: str
    html: str = ""
    figures: dict[str, bytes] = field(default_factory=dict)

    def figure_files(self) -> dict[str, str]:
        """File name of each figure when written: ``<key>-<name>.png``."""
        return {name: f"{self.key}-{_file_stem(name)}.png" for name in self.figures}


SectionBuilder = Callable[[ReportContext], Section]


@dataclass
class Report:
    sections: list[Section] = field(default_factory=list)
    title: str = "qlens report"

    def to_json(self) -> dict[str, Any]:
        data = {section.key: section.data for section in self.sections}
        data["figures"] = [f for s in self.sections for f in s.figure_files().values()]
        return data

    def to_text(self) -> str:
        return "\n\n".join(f"== {s.title} ==\n{s.text}" for s in self.sections) + "\n"

    def to_html(self) -> str:
        """A self-contained page: figures inline as base64 PNGs, no scripts, no external URLs."""
        from qlens.report.page import render_page

        return render_page(self.title, self.sections)

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write ``report.json``, ``report.html`` and one PNG per figure into ``out_dir`` (created
        if needed); returns the paths written."""
        directory = Path(out_dir)
        directory.mkdir(parents=True, exist_ok=True)
        written = [directory / "report.json", directory / "report.html"]
        written[0].write_text(json.dumps(self.to_json(), indent=2) + "\n")
        written[1].write_text(self.to_html())
        for section in self.sections:
            for name, file_name in section.figure_files().items():
                path = directory / file_name
                path.write_bytes(section.figures[name])
                written.append(path)
        return written


def default_sections() -> list[SectionBuilder]:
    from qlens.report import audit_section, capture, drift, heads, predictions, residual, run_info

    return [
        run_info.section,
        audit_section.section,
        predictions.section,
        drift.section,
        heads.section,
        capture.section,
        residual.section,
    ]


def build_report(
    bridge: Bridge,
    prompt: str,
    *,
    schemes: Sequence[str] = (),
    top_k: int = 10,
    model_label: str = "",
    sections: list[SectionBuilder] | None = None,
    progress: bool = False,
) -> Report:
    """Run ``prompt`` once with every hook point cached, quantize a copy of the model with each of
    ``schemes`` (``qlens.quantize``), then build each section. ``progress`` shows a progress bar
    on stderr."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}.")
    schemes = check_schemes(schemes)
    builders = sections or default_sections()
    with tqdm(
        total=1 + len(schemes) + len(builders), desc="qlens report", disable=not progress
    ) as bar:
        bar.set_postfix_str("running the prompt")
        tokens = bridge.to_tokens(prompt)
        with torch.no_grad():
            logits, cache = bridge.run_with_cache(tokens, return_cache_object=True)
        assert isinstance(cache, ActivationCache)
        variants = [base_variant(bridge, logits)]
        bar.update()
        for scheme in schemes:
            bar.set_postfix_str(f"quantizing to {scheme}")
            variants.append(quantized_variant(variants[0], scheme, tokens))
            bar.update()
        context = ReportContext(bridge, model_label, prompt, tokens, logits, cache, top_k, variants)
        built = []
        for build in builders:
            bar.set_postfix_str(_step_name(build))
            built.append(build(context))
            bar.update()
    title = f"qlens report: {model_label}" if model_label else "qlens report"
    return Report(built, title)


def _file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "figure"


def _step_name(build: SectionBuilder) -> str:
    module = getattr(build, "__module__", "") or ""
    return module.rsplit(".", 1)[-1].removesuffix("_section").replace("_", " ")
