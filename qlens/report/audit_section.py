"""Report section: the quantization audit of every model version."""

from __future__ import annotations

import html
import re

from qlens.formatting import format_bytes as human_bytes
from qlens.report import plots
from qlens.report.audit import WeightAudit, WeightRow
from qlens.report.build import ReportContext, Section
from qlens.report.page import Bytes, table


def weight_kind(name: str) -> str:
    """A weight name without its layer index: `model.layers.3.mlp.up_proj.weight` ->
    `model.layers.*.mlp.up_proj.weight`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def grouped_rows(rows: list[WeightRow]) -> list[dict]:
    """Rows grouped by weight kind, format and readability (in order of first appearance)."""
    groups: dict[tuple[str, str, bool], dict] = {}
    for row in rows:
        key = (weight_kind(row.name), row.format, row.readable)
        group = groups.setdefault(
            key,
            {
                "kind": key[0],
                "format": row.format,
                "readable": row.readable,
                "count": 0,
                "bits_per_weight": row.bits_per_weight,
                "bytes": 0,
            },
        )
        group["count"] += 1
        group["bytes"] += row.bytes
        if group["bits_per_weight"] != row.bits_per_weight:
            group["bits_per_weight"] = None
    return list(groups.values())


def section(context: ReportContext) -> Section:
    audits = {variant.label: variant.audit for variant in context.variants}
    data = {label: audit.to_dict() for label, audit in audits.items()}
    text = "\n\n".join(_variant_text(label, audit) for label, audit in audits.items())
    page = "".join(_variant_html(label, audit) for label, audit in audits.items())
    figure = plots.weight_bytes_png(
        list(audits),
        [audit.total_bytes / 2**20 for audit in audits.values()],
        [f"x{audit.compression_ratio:.2f}" for audit in audits.values()],
    )
    return Section(
        "audit",
        "Quantization audit (every weight)",
        data,
        text,
        html=page,
        figures={"weight_bytes": figure},
    )


def _totals_line(audit: WeightAudit) -> str:
    totals = audit.totals()
    return (
        f"{totals['weights']} weights ({totals['readable']} readable, "
        f"{totals['unreadable']} unreadable), {human_bytes(totals['bytes'])}, "
        f"{totals['bits_per_weight']:.2f} bits/weight, compression x{totals['compression_ratio']:.2f} "
        f"vs {totals['baseline_dtype']} ({human_bytes(totals['baseline_bytes'])})"
    )


def _bits(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _variant_text(label: str, audit: WeightAudit) -> str:
    groups = grouped_rows(audit.rows)
    width = max((len(g["kind"]) for g in groups), default=0)
    lines = [f"{label}: {_totals_line(audit)}"]
    for g in groups:
        state = "readable" if g["readable"] else "UNREADABLE"
        lines.append(
            f"  {g['kind']:<{width}}  x{g['count']:<3} {g['format']:<10} "
            f"{_bits(g['bits_per_weight']):>6} bits  {state:<10} {human_bytes(g['bytes'])}"
        )
    return "\n".join(lines)


def _variant_html(label: str, audit: WeightAudit) -> str:
    groups = table(
        ["weights", "count", "format", "bits/weight", "readable", "bytes"],
        [
            [
                g["kind"],
                g["count"],
                g["format"],
                _bits(g["bits_per_weight"]),
                g["readable"],
                Bytes(g["bytes"]),
            ]
            for g in grouped_rows(audit.rows)
        ],
    )
    every = table(
        ["weight", "shape", "readable", "format", "bits/weight", "bytes", "why unreadable"],
        [
            [
                r.name,
                list(r.shape),
                r.readable,
                r.format,
                _bits(r.bits_per_weight),
                Bytes(r.bytes),
                r.reason or "",
            ]
            for r in audit.rows
        ],
    )
    return (
        f"<h3>{html.escape(label)}</h3><p>{html.escape(_totals_line(audit))}</p>{groups}"
        f"<details><summary>all {len(audit.rows)} weights</summary>{every}</details>"
    )
