"""No function in ``src/fedfuse`` is more complex than the design allows, and docs/design.md's table of the
largest ones is the measured one (radon's cyclomatic complexity, as ``radon cc -s -n C src`` reports it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fedfuse

radon = pytest.importorskip("radon.complexity", reason="needs radon: pip install -e '.[test]'")
radon_visitors = pytest.importorskip("radon.visitors")

SRC = Path(fedfuse.__file__).parent
DESIGN = SRC.parent.parent / "docs" / "design.md"
LIMIT = 25  # the design's ceiling for one function
SHOWN = 5  # how many of the largest docs/design.md lists


def measured() -> list[tuple[int, str, str]]:
    """(complexity, function, file relative to src/fedfuse) of every function and method, largest first."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        for block in radon.cc_visit(path.read_text()):
            if isinstance(block, radon_visitors.Class):  # its methods are listed on their own
                continue
            for b in (block, *block.closures):
                name = f"{b.classname}.{b.name}" if b.classname else b.name
                out.append((b.complexity, name, str(path.relative_to(SRC))))
    return sorted(out, key=lambda t: (-t[0], t[2], t[1]))


def render(rows: list[tuple[int, str, str]]) -> str:
    """The Markdown table docs/design.md shows."""
    lines = ["| complexity | function | file |", "|---|---|---|"]
    lines += [f"| {c} | `{name}` | `{file}` |" for c, name, file in rows[:SHOWN]]
    return "\n".join(lines)


def test_no_function_is_above_the_limit():
    over = [f"{file}: {name} ({c})" for c, name, file in measured() if c > LIMIT]
    assert not over, f"functions above complexity {LIMIT}:\n" + "\n".join(over)


def test_design_doc_lists_the_largest_functions():
    text = DESIGN.read_text()
    m = re.search(r"\| complexity \| function \| file \|\n\|---\|---\|---\|\n(?:\|.*\|\n)+", text)
    assert m, "docs/design.md has no complexity table"
    assert m.group(0).strip() == render(measured()), "docs/design.md's complexity table is stale; it should read:\n" \
        + render(measured())
