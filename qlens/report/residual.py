"""Report section: the size of the residual stream after each layer."""

from __future__ import annotations

from qlens.report.build import ReportContext, Section


def section(context: ReportContext) -> Section:
    rows = []
    for layer in range(context.bridge.cfg.n_layers):
        resid = context.cache[f"blocks.{layer}.hook_resid_post"][0].float()  # [pos, d_model]
        norms = resid.norm(dim=-1)
        rows.append(
            {
                "layer": layer,
                "norm_last_position": float(norms[-1]),
                "norm_mean": float(norms.mean()),
            }
        )
    text = "layer  |resid_post| last position  mean over positions\n" + "\n".join(
        f"{row['layer']:>5}  {row['norm_last_position']:>24.2f}  {row['norm_mean']:>19.2f}"
        for row in rows
    )
    return Section("residual_norms", "Residual stream norm per layer (hook_resid_post)", rows, text)
