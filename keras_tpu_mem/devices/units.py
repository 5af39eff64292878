"""Byte units and how the package prints a byte count."""

from __future__ import annotations

GIB = 1024**3
GB = 1000**3


def format_bytes(num: int | float | None) -> str:
    """Formats a byte count as `"1.50 GiB"`; `None` becomes `"unknown"`."""
    if num is None:
        return "unknown"
    num = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"  # pragma: no cover
