"""Plain-text tables for command output (no colour, no width detection: stable in logs and tests)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_bytes", "format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces; one line per row, headers first."""
    cells = [[str(h) for h in headers]] + [
        ["" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(indent + line for line in lines)


def format_bytes(n: int) -> str:
    """`1.5 MiB`-style size; exact bytes below 1 KiB."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
