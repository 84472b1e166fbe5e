"""The command line answers at once: ``--help``, argument errors, ``list`` and ``show`` import no torch and none
of an algorithm's heavy dependencies (checked on the modules a fresh interpreter loaded, not on a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedfuse

#: the interpreter runs the fedfuse under test (tests run in a temporary directory, where a relative PYTHONPATH
#: would find another copy)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fedfuse.__file__).parents[1]),
                                                     os.environ.get("PYTHONPATH", "")])}

#: what a command that only prints text must not import (each costs from 0.1 to several CPU-seconds)
HEAVY = ("torch", "numpy", "pandas", "matplotlib", "scipy", "sklearn", "flwr", "transformers", "peft", "opacus",
         "fedfuse.algorithms", "fedfuse.models", "fedfuse.data", "fedfuse.engine", "fedfuse.runner")

PROBE = """
import contextlib, io, json, sys
from fedfuse.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "modules": sorted(sys.modules)}))
"""


def _run(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True,
                          timeout=120, env=ENV)
    return json.loads(done.stdout)


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["run", "--help"], 0), (["run", "--rouns", "5"], 2),
                                       (["run", "--rounds", "x"], 2), (["list"], 0), (["show", "fedprox"], 0),
                                       (["show", "config"], 0), (["show", "cnn"], 0), (["compare", "--help"], 0),
                                       (["flower-app", "--help"], 0), (["rnu"], 2), ([], 2)])
def test_text_only_commands_import_no_torch(argv, code):
    res = _run(*argv)
    assert res["code"] == code, res["err"]
    loaded = [m for m in HEAVY if m in res["modules"]]
    assert loaded == [], f"fedfuse {' '.join(argv)} imported {loaded}"


def test_help_imports_no_torch_by_importtime():
    """``python -X importtime -m fedfuse --help`` lists every module the interpreter imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "fedfuse", "--help"], capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert done.returncode == 0 and "run" in done.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "fedfuse.cli" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy", "pandas", "matplotlib", "scipy")}


def test_the_package_imports_lazily_and_its_api_still_resolves():
    code = ("import sys, fedfuse; lazy = 'torch' not in sys.modules and 'fedfuse.api' not in sys.modules; "
            "print(lazy, callable(fedfuse.run), callable(fedfuse.show), fedfuse.Component.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env=ENV)
    assert done.stdout.split() == ["True", "True", "True", "fedfuse.catalog"]


def test_other_commands_still_build_their_arguments():
    """A command whose flags come from torch-importing modules is built when it is the command: reproductions
    list their families, pretrain its presets."""
    res = _run("reproduce", "--help")
    assert res["code"] == 0 and "fedmr" in res["out"]
    res = _run("pretrain", "--help")
    assert res["code"] == 0 and "--size" in res["out"]
