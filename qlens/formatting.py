"""Human-readable formatting shared by reprs, reports and viewers."""


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: bytes in binary units, one decimal above bytes."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
