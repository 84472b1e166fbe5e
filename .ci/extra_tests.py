"""Print the test files that touch an optional extra, one per line (``.ci/run`` runs them in an environment with
only the README's quick-start install, where each test needing an extra must skip with its one-line reason).

Derived, not listed: a test file touches an extra when its source

- imports a module of an extra (``fedfuse.extras.EXTRAS``), or skips on one (``pytest.importorskip``,
  ``needs_extra(...)``);
- imports a fedfuse module that imports one (found by reading ``src/fedfuse`` with :mod:`ast`: imports at any
  depth, ``import_extra``; a module that only checks one with ``require_extra`` does not count);
- names a feature that needs one: an algorithm declaring ``extras``, a reproduction whose ``Family`` declares
  ``extras``, a logger with an ``extra``, ``dp=local``, ``--executor flower``, an ``hf:`` dataset or a ``flwr:``
  partition.

Run from the repository root: ``python3 .ci/extra_tests.py`` (needs fedfuse importable, no extra).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fedfuse.algorithms import ALGORITHMS  # noqa: E402
from fedfuse.engine.callbacks import LOGGERS  # noqa: E402
from fedfuse.extras import EXTRAS  # noqa: E402
from fedfuse.reproduce import available  # noqa: E402

EXTRA_MODULES = {m for mods in EXTRAS.values() for m in mods}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def fedfuse_modules_using_extras(src: Path = ROOT / "src") -> set[str]:
    """fedfuse modules whose code imports a module of an extra (at any depth)."""
    out = set()
    for path in (src / "fedfuse").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in
                  ("import_extra", "_need") and node.args
                  and isinstance(node.args[0], ast.Constant)):
                names = [str(node.args[0].value)]
            if any(n.split(".")[0] in EXTRA_MODULES or n in EXTRAS for n in names):
                out.add(_module_name(path, src))
                break
    return out


def feature_patterns() -> list[str]:
    """Regular expressions of the features that need an extra, as a test names them."""
    algorithms = [name for name, cls in ALGORITHMS.items() if cls.extras]
    families = [name for name, fam in available().items() if fam.extras]
    loggers = [name for name, cls in LOGGERS.items() if cls.extra in EXTRAS]
    words = sorted({*algorithms, *families, *loggers}, key=len, reverse=True)
    return [
        r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?![\w-])",
        r"\bdp\W{1,4}local\b",  # dp=local, dp="local", "dp": "local"
        r"executor\W{1,4}flower\b",
        r"[\"']hf:",
        r"[\"']flwr:",
        r"\bimportorskip\(|\bneeds_extra\(",
    ]


def extra_test_files(tests: Path = ROOT / "tests") -> list[Path]:
    """The test files that touch an optional extra (see the module docstring), sorted."""
    modules = fedfuse_modules_using_extras()
    imports = re.compile(r"^\s*(?:from|import)\s+(" + "|".join(map(re.escape, sorted(EXTRA_MODULES))) + r")\b", re.M)
    uses = re.compile(r"\b(" + "|".join(re.escape(m) for m in sorted(modules)) + r")\b")
    features = [re.compile(p) for p in feature_patterns()]
    out = []
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text()
        if imports.search(text) or uses.search(text) or any(p.search(text) for p in features):
            out.append(path)
    return out


if __name__ == "__main__":
    for p in extra_test_files():
        print(p.relative_to(ROOT))
