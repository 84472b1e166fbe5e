"""Markdown tables: one row per dict, one column per key (in order of first appearance)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def markdown(rows: Iterable[dict[str, Any]]) -> str:
    """A Markdown table of ``rows``; a missing or ``None`` cell shows as an em dash."""
    rows = list(rows)
    if not rows:
        return ""
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def cell(v: Any) -> str:
    """One table cell as text, the same in Markdown and HTML: a missing value (None, NaN) is an em dash."""
    return _cell(v)


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)
