"""Report section: what `run_with_cache` captured, grouped by kind of hook point."""

from __future__ import annotations

import re

from qlens.formatting import format_bytes as _human_bytes
from qlens.report.build import ReportContext, Section


def hook_kind(name: str) -> str:
    """The hook name without its layer index: `blocks.3.attn.hook_z` -> `blocks.*.attn.hook_z`."""
    return re.sub(r"^blocks\.\d+\.", "blocks.*.", name)


def section(context: ReportContext) -> Section:
    kinds: dict[str, dict] = {}
    total_bytes = context.cache.total_bytes
    for name, tensor in context.cache.items():
        size = tensor.numel() * tensor.element_size()
        entry = kinds.setdefault(
            hook_kind(name),
            {
                "count": 0,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "bytes": 0,
            },
        )
        entry["count"] += 1
        entry["bytes"] += size
        if entry["shape"] != list(tensor.shape):
            entry["shape"] = "varies"
    data = {
        "hook_points": len(context.bridge.hook_names),
        "cached_tensors": sum(kind["count"] for kind in kinds.values()),
        "total_bytes": total_bytes,
        "kinds": kinds,
    }
    lines = [
        f"hook points: {data['hook_points']}, cached tensors: {data['cached_tensors']}, "
        f"total {_human_bytes(total_bytes)}"
    ]
    width = max(len(kind) for kind in kinds) if kinds else 0
    for kind, info in kinds.items():
        shape = (
            "varies"
            if info["shape"] == "varies"
            else "[" + ", ".join(map(str, info["shape"])) + "]"
        )
        lines.append(
            f"  {kind:<{width}}  x{info['count']:<3} {shape:<22} {info['dtype']:<9} {_human_bytes(info['bytes'])}"
        )
    return Section("capture", "Captured activations", data, "\n".join(lines))
