"""Which tests touch an optional extra (``pip install 'fedfuse[EXTRA]'``), derived from the code, not listed.

``.ci/run`` runs these tests in a venv with only the README's quick-start install, where each must pass or skip
with its one-line reason: ``.ci/extra_tests.py`` prints the files (:func:`extra_test_files`), and
``-m extra`` selects the tests in them (``conftest.py`` marks the tests :func:`select` picks).

A piece of test code touches an extra when its source

- imports a module of an extra (:data:`fedfuse.extras.EXTRAS`) or skips on one (``importorskip``,
  ``needs_extra``);
- names a fedfuse module that imports one (found by reading ``src/fedfuse`` with :mod:`ast`: imports at any
  depth, ``import_extra``; a module that only checks one with ``require_extra`` does not count);
- names a feature that needs one: an algorithm declaring ``extras``, a reproduction whose ``Family`` declares
  ``extras``, a logger with an ``extra``, ``dp=local``, ``executor flower``, an ``hf:`` dataset or a ``flwr:``
  partition.

A test touches an extra when its file does so outside any function or class (e.g. a module-level
``importorskip``), or its function, its parameters' id, or a function or fixture of its file that it names does.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

from fedfuse.algorithms import ALGORITHMS
from fedfuse.engine.callbacks import LOGGERS
from fedfuse.extras import EXTRAS
from fedfuse.reproduce import available

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
EXTRA_MODULES = {m for mods in EXTRAS.values() for m in mods}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def fedfuse_modules_using_extras() -> set[str]:
    """fedfuse modules whose code imports a module of an extra (at any depth)."""
    out = set()
    for path in (SRC / "fedfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", ""))
                  in ("import_extra", "_need") and node.args and isinstance(node.args[0], ast.Constant)):
                names = [str(node.args[0].value)]
            if any(n.split(".")[0] in EXTRA_MODULES for n in names):
                out.add(_module_name(path))
                break
    return out


@functools.cache
def _words() -> tuple[str, ...]:
    """Names of the features that need an extra, longest first."""
    words = {name for name, cls in ALGORITHMS.items() if cls.extras}
    words |= {name for name, fam in available().items() if fam.extras}
    words |= {name for name, cls in LOGGERS.items() if cls.extra in EXTRAS}
    return tuple(sorted(words, key=len, reverse=True))


@functools.cache
def id_pattern() -> re.Pattern[str]:
    """A feature name in a parametrized test's id (pytest joins parameters with ``-``: ``fedit-rank``)."""
    return re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, _words())) + r")(?!\w)")


@functools.cache
def pattern() -> re.Pattern[str]:
    """One regular expression for everything that touches an extra (see the module docstring)."""
    words = _words()
    alternatives = [
        r"^\s*(?:from|import)\s+(?:" + "|".join(map(re.escape, sorted(EXTRA_MODULES))) + r")\b",
        r"\b(?:" + "|".join(map(re.escape, sorted(fedfuse_modules_using_extras()))) + r")\b",
        r"(?<![\w-])(?:" + "|".join(map(re.escape, words)) + r")(?![\w-])",
        r"\bdp\W{1,4}local\b",  # dp=local, dp="local", "dp": "local"
        r"executor\W{1,4}flower\b",
        r"[\"']hf:",
        r"[\"']flwr:",
        r"\bimportorskip\(|\bneeds_extra\(",
    ]
    return re.compile("|".join(f"(?:{a})" for a in alternatives), re.M)


def touches(text: str) -> bool:
    """``text`` (test source) touches an optional extra."""
    return pattern().search(text) is not None


def extra_test_files(tests: Path = TESTS) -> list[Path]:
    """The test files that touch an optional extra anywhere, sorted."""
    return [p for p in sorted(tests.rglob("test_*.py")) if touches(p.read_text())]


def _executes(node: ast.stmt) -> bool:
    """A module-level statement that runs something when the file is imported (an import, a call), as opposed
    to a definition or a literal table."""
    return isinstance(node, ast.Import | ast.ImportFrom) or any(isinstance(n, ast.Call) for n in ast.walk(node))


@functools.cache
def _file(path: str) -> tuple[bool, frozenset[str]]:
    """(code run at import touches an extra, names of the file's functions and tables that do)."""
    text = Path(path).read_text()
    outside, touching = False, set()
    for node in ast.parse(text).body:
        if not touches(ast.get_source_segment(text, node) or ""):
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            touching.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and not _executes(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            touching |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif _executes(node):
            outside = True
    return outside, frozenset(touching)


def _function_touches(item: Any, touching: frozenset[str]) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(item.function))
    except (OSError, TypeError):
        return True  # cannot tell: run it
    if touches(source):
        return True
    named = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    return bool((named | set(getattr(item, "fixturenames", ()))) & touching)


def select(items: list[Any]) -> list[Any]:
    """The tests among ``items`` that touch an optional extra (see the module docstring).  A test parametrized
    over names some of which touch one (``test_golden_final_metrics[fedit]``) is selected for those only."""
    by_function: dict[tuple[str, str], list[Any]] = {}
    for item in items:
        by_function.setdefault((str(item.path), getattr(item, "originalname", item.name)), []).append(item)
    out = []
    for (path, _), group in by_function.items():
        outside, touching = _file(path)
        if outside:
            out += group
            continue
        ids = [getattr(getattr(item, "callspec", None), "id", "") for item in group]
        hits = [touches(i) or id_pattern().search(i) is not None for i in ids]
        if any(hits):
            out += [item for item, hit in zip(group, hits, strict=True) if hit]
        elif _function_touches(group[0], touching):
            out += group
    return out
