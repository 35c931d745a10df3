"""Report section: per-layer drift of each quantized copy from the reference, on the prompt."""

from __future__ import annotations

import html

from qlens.analysis import quantization_drift
from qlens.report import plots
from qlens.report.build import ReportContext, Section
from qlens.report.lens_drift import lens_probabilities, quantized_lens_kl
from qlens.report.page import table

# Per-layer columns: (key in the drift data, column name).
COLUMNS = (("resid_cosine", "cosine"), ("resid_rel_error", "rel.err"), ("lens_kl", "lens KL"))


def section(context: ReportContext) -> Section:
    title = "Quantization drift from the reference (on the prompt)"
    reference = context.reference
    if reference is None or not context.quantized:
        why = (
            "no float reference: the model was loaded already quantized "
            f"({context.variants[0].label})"
            if reference is None
            else "no quantized version to compare (no quantization scheme was asked for)"
        )
        return Section("drift", title, {"skipped": why}, why)
    reference_probs = lens_probabilities(reference.bridge, context.cache)
    reports = {}
    for variant in context.quantized:
        drift = quantization_drift(reference.bridge, variant.bridge, context.tokens).to_dict()
        drift["lens_kl"] = quantized_lens_kl(reference_probs, variant.bridge, context.tokens)
        reports[variant.label] = drift
    labels = list(reports)
    header = ["layer"] + [f"{label} {name}" for label in labels for _, name in COLUMNS]
    rows = [
        [layer] + [reports[label][key][layer] for label in labels for key, _ in COLUMNS]
        for layer in range(len(reports[labels[0]]["resid_cosine"]))
    ]
    summary = [
        f"{label}: logit KL(reference || {label}) = {r['logit_kl']:.4g} nats, top-1 agreement "
        f"{r['top1_agreement']:.0%}, top-{r['k']} overlap {r['topk_overlap']:.0%} "
        f"({r['n_tokens']} tokens)"
        for label, r in reports.items()
    ]
    widths = [len(h) + 2 if i else len(h) for i, h in enumerate(header)]
    lines = [
        "after each layer (hook_resid_post), mean over tokens: residual cosine and relative "
        "error, and KL(reference || quantized) in nats of the logit-lens next-token distributions",
        "".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)),
        *(
            "".join(
                f"{v:>{w}}" if isinstance(v, int) else f"{v:>{w}.5g}"
                for v, w in zip(row, widths, strict=True)
            )
            for row in rows
        ),
        *summary,
    ]
    figure = plots.per_layer_lines_png(
        {
            "residual cosine to the reference": {k: r["resid_cosine"] for k, r in reports.items()},
            "residual relative error": {k: r["resid_rel_error"] for k, r in reports.items()},
            "logit-lens KL (nats)": {k: r["lens_kl"] for k, r in reports.items()},
        }
    )
    page = (
        f"<p>{html.escape(lines[0])}</p><p>"
        + "<br>".join(html.escape(line) for line in summary)
        + "</p>"
        + table(header, rows)
    )
    return Section(
        "drift", title, reports, "\n".join(lines), html=page, figures={"per_layer_drift": figure}
    )
