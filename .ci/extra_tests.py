"""Print the test files that touch an optional extra, one per line: ``.ci/run`` runs the tests in them that do
(``-m extra``) in a venv with only the README's quick-start install, where each must pass or skip with its
one-line reason.  The list is derived from the code by ``tests/extra_use.py`` (its docstring says how).

Run from the repository root: ``python3 .ci/extra_tests.py`` (needs fedfuse importable, no extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from extra_use import extra_test_files  # noqa: E402

if __name__ == "__main__":
    for p in extra_test_files():
        print(p.relative_to(ROOT))
