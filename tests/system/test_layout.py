"""Tests mirror ``src/fedfuse``: a thing's tests are found by its path.

``tests/<pkg>/test_<module>.py`` tests ``src/fedfuse/<pkg>/<module>.py`` (``tests/test_<module>.py`` a top-level
module, ``test_<subpackage>.py`` a subpackage as a whole). A file may add an aspect after the module's name
(``test_msfusion_properties.py``) or, where two modules share a name, lead with its package
(``tests/reproduce/test_reproduce_fedmr.py``), because pytest's default import mode needs unique basenames.
Suites about the whole system live in ``tests/system/``, each listed with one line in the table of
``docs/design.md`` (section *Tests*). Every algorithm module has its own test file.

``python3 tests/system/test_layout.py`` prints the modules that have no test file of their own (the list in
``docs/design.md``); they are covered by the system suites or by a neighbour's file, and the list is not enforced.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SRC = ROOT / "src" / "fedfuse"
DESIGN = ROOT / "docs" / "design.md"
SYSTEM = "system"
HELPERS = {"golden"}  # helper packages under tests/, not test folders
NOT_ALGORITHMS = {"__init__", "base", "lora_base", "mean_base"}  # the contract and shared base classes


def collect_test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def units(pkg: Path) -> set[str]:
    """Names a test file in the mirror of ``pkg`` may be named after: its modules and subpackages."""
    mods = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    subs = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    return mods | subs


def unit_of(path: Path) -> tuple[Path, str] | None:
    """``(package dir, unit)`` a mirror test file is named after, or ``None`` when it fits no module."""
    rel = path.relative_to(TESTS).parent
    pkg = SRC.joinpath(*rel.parts)
    if not pkg.is_dir():
        return None
    name = path.stem.removeprefix("test_")
    prefix = f"{rel.parts[-1]}_" if rel.parts else ""
    for cand in (name, name.removeprefix(prefix) if prefix else name):
        for unit in sorted(units(pkg), key=len, reverse=True):  # longest first: fedmr_secure before fedmr
            if cand == unit or cand.startswith(unit + "_"):
                return pkg, unit
    return None


def system_table() -> dict[str, str]:
    """``file name → one line`` from the table under ``## Tests`` in docs/design.md."""
    text = DESIGN.read_text()
    section = text.split("\n## Tests", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `tests/system/(test_\w+\.py)` \| (.+?) \|$", section, re.M))


def untested() -> list[str]:
    """Modules of ``src/fedfuse`` without a test file of their own (nor one for their whole package), as paths
    relative to ``src/fedfuse``; package ``__init__`` and ``__main__`` files are left out."""
    covered = {hit for f in collect_test_files() if (hit := unit_of(f))}
    return [str(py.relative_to(SRC)) for py in sorted(SRC.rglob("*.py"))
            if py.stem not in ("__init__", "__main__")
            and (py.parent, py.stem) not in covered and (py.parent.parent, py.parent.name) not in covered]


def test_every_test_file_is_named_after_a_module_or_listed_as_a_system_suite():
    table = system_table()
    wrong = []
    for f in collect_test_files():
        rel = f.relative_to(TESTS)
        if rel.parts[0] in HELPERS:
            continue
        if rel.parts[0] == SYSTEM:
            if len(rel.parts) != 2 or f.name not in table:
                wrong.append(f"{rel}: a system suite missing from the table in docs/design.md (## Tests)")
        elif unit_of(f) is None:
            wrong.append(f"{rel}: names no module of src/fedfuse/{'/'.join(rel.parts[:-1])}")
    assert not wrong, "\n".join(wrong)


def test_the_system_table_lists_existing_files_only():
    table = system_table()
    assert table, "docs/design.md has no table of tests/system/ under ## Tests"
    present = {f.name for f in (TESTS / SYSTEM).glob("test_*.py")}
    assert set(table) <= present, f"listed but absent: {sorted(set(table) - present)}"
    assert all(line.strip() for line in table.values())


def test_basenames_are_unique_and_test_folders_are_not_packages():
    """pytest's default (prepend) import mode imports each test file by its basename."""
    seen: dict[str, Path] = {}
    for f in collect_test_files():
        assert f.name not in seen, f"{f.relative_to(TESTS)} and {seen[f.name].relative_to(TESTS)} share a basename"
        seen[f.name] = f
        assert not (f.parent / "__init__.py").exists(), f"{f.parent} must not be a package"


def test_every_algorithm_module_has_its_own_test_file():
    algos = {p.stem for p in (SRC / "algorithms").glob("*.py")} - NOT_ALGORITHMS
    have = {hit[1] for f in (TESTS / "algorithms").glob("test_*.py") if (hit := unit_of(f))}
    missing = sorted(algos - have)
    assert not missing, f"algorithm modules without tests/algorithms/test_<module>.py: {missing}"


def test_the_rule_on_examples():
    """The naming rule on known cases, so a change to it is seen."""
    assert unit_of(TESTS / "algorithms" / "test_fedmr_secure.py") == (SRC / "algorithms", "fedmr_secure")
    assert unit_of(TESTS / "algorithms" / "test_msfusion_properties.py") == (SRC / "algorithms", "msfusion")
    assert unit_of(TESTS / "reproduce" / "test_reproduce_fedmr.py") == (SRC / "reproduce", "fedmr")
    assert unit_of(TESTS / "test_config.py") == (SRC, "config")
    assert unit_of(TESTS / "data" / "test_datasets.py") == (SRC / "data", "datasets")
    assert unit_of(TESTS / "algorithms" / "test_nosuch.py") is None
    assert unit_of(TESTS / "nosuchpkg" / "test_x.py") is None


if __name__ == "__main__":
    sys.stdout.write("".join(f"- `{m}`\n" for m in untested()))
