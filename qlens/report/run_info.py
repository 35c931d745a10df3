"""Report section: which model ran on which tokens, and which versions of it are compared."""

from __future__ import annotations

from qlens.report.build import ReportContext, Section


def section(context: ReportContext) -> Section:
    bridge = context.bridge
    parameter = next(bridge.model.parameters())
    str_tokens = bridge.to_str_tokens(context.tokens[0])
    data = {
        "model": context.model_label,
        "architecture": type(bridge.model).__name__,
        "n_layers": bridge.cfg.n_layers,
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "device": str(parameter.device),
        "prompt": context.prompt,
        "tokens": str_tokens,
        "versions": [
            {"label": v.label, "role": v.role, "scheme": v.scheme} for v in context.variants
        ],
    }
    text = "\n".join(
        [
            f"model: {data['model']} ({data['architecture']}, {data['n_layers']} layers, "
            f"{data['dtype']} on {data['device']})",
            f"prompt: {context.prompt!r} -> {len(str_tokens)} tokens {str_tokens!r}",
            "versions: " + ", ".join(f"{v.label} ({v.role})" for v in context.variants),
        ]
    )
    return Section("run", "Run", data, text)
