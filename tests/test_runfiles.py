"""The run directory's file names: one table says what each file holds and who writes it, and no other module
spells a name (so "where is metrics.jsonl written" has one answer)."""

import ast
from pathlib import Path

import fedfuse
from fedfuse import runfiles

SRC = Path(fedfuse.__file__).parent
NAMES = {v for k, v in vars(runfiles).items() if k.isupper() and isinstance(v, str)}


def test_the_table_lists_every_name_and_the_run_files_are_in_it():
    assert set(runfiles.FILES) == NAMES
    assert set(runfiles.RUN_FILES) <= set(runfiles.REPLACED) <= set(runfiles.FILES)
    assert all(what and writer for what, writer in runfiles.FILES.values())


def test_no_other_module_spells_a_run_file_name():
    """Every string constant equal to a run file's name (f-string parts and path pieces too) is in
    ``fedfuse.runfiles``; prose in docstrings and messages is free to mention them.  (The ``tensorboard``
    directory shares its name with the extra, so only names with a suffix are checked.)"""
    files = {n for n in NAMES if "." in n}
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "runfiles.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in files:
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert not bad, "run file names spelled outside fedfuse.runfiles:\n  " + "\n  ".join(bad)
