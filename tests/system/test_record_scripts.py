"""The record scripts of reproduction outputs (``results/record-*.sh`` calling ``results/reproduction_cells.py``)
agree with the reproductions they record: each script's table-id pattern matches the table ids the reproduction
plans, the cells it makes have the keys of the table spec's rows, and every committed record's cell is one of
them.  Checked by planning the reproductions (no training) and a results.json built from the plan."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex

import pytest

from fedfuse.cli import make_parser
from fedfuse.records import load_records, load_spec, repo_root
from fedfuse.reproduce import available
from fedfuse.reproduce.common import seeds

ROOT = repo_root()


def args_of(name: str, *flags: str):
    return make_parser().parse_args(["reproduce", name, "--data-dir", "/data", *flags])


def _cells_module():
    spec = importlib.util.spec_from_file_location("reproduction_cells", ROOT / "results" / "reproduction_cells.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def script_call(script: str) -> tuple[str, str, str]:
    """(table id or "$TABLE", table-id regex, cell template) of a record script's reproduction_cells.py call and
    its ``fedfuse results record --table`` argument."""
    text = (ROOT / "results" / script).read_text().replace("\\\n", " ")
    call = next(line for line in text.splitlines() if "reproduction_cells.py" in line and "python3" in line)
    argv = shlex.split(call.split("reproduction_cells.py", 1)[1].lstrip("\"").split("|")[0])
    table = re.search(r"results record --table (\S+)", text).group(1).strip('"')
    return table, argv[1], argv[2]


#: script, the table it fills, and the reproduction invocations (family, flags) its records came from
CASES = [
    ("record-fedma.sh", "fedma-clients", [("fedma", ("--part", "mlp", "--clients", "2,5,10", "--comms", "4,20",
                                                     "--optimizers", "sgd"))]),
    ("record-msfusion-cifar.sh", "msfusion-cifar40", [("msfusion", ("--parts", "cifar", "--mus", "0.25",
                                                                    "--cifar-splits", "non-iid"))]),
    ("record-fedmr.sh", "fedmr-full", [("fedmr", ("--scale", "full"))]),
    ("record-fedmr.sh", "fedmr-cpu", [("fedmr", ("--settings", "cifar10-dir0.1,cifar10-dir0.5,cifar10-iid,femnist,"
                                                "mnist-dir0.1,mnist-dir0.5"))]),
]


@pytest.mark.parametrize(("script", "table", "invocations"), CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_record_script_cells_match_the_reproduction_and_the_records(script, table, invocations):
    mod = _cells_module()
    target, table_re, template = script_call(script)
    assert target in (table, "$TABLE")
    keys = set(load_spec(ROOT, table)["rows"])
    made: set[str] = set()
    for family, flags in invocations:
        args = args_of(family, *flags)
        planned = available()[family].tables(args)
        results = {t.id: {"runs": {label: [{"seed": s, "dir": f"/runs/{t.id}/{label}/s{s}"} for s in seeds(args)]
                                   for label in t.rows}} for t in planned}
        cells = mod.cells(results, table_re, template)
        assert cells, f"{script}: its pattern {table_re!r} matches no table of `reproduce {family}`"
        for cell, dirs in cells:
            parsed = dict(part.split("=", 1) for part in cell.split(","))
            assert set(parsed) == keys, (cell, keys)
            assert len(dirs) == len(seeds(args)) and all(d.startswith("/runs/") for d in dirs)
            made.add(json.dumps({k: str(v) for k, v in parsed.items()}, sort_keys=True))
    for rec in load_records(ROOT, table):
        cell = json.dumps({k: str(v) for k, v in rec["cell"].items()}, sort_keys=True)
        assert cell in made, f"record cell {cell} is not one the script makes"


def test_cells_by_hand():
    mod = _cells_module()
    results = {"mlp-sgd-5clients-4comms": {"runs": {"fedma": [{"dir": "a"}, {"dir": "b"}]}},
               "other": {"runs": {"x": [{"dir": "c"}]}}}
    got = mod.cells(results, r"mlp-sgd-(?P<clients>\d+)clients-(?P<comms>\d+)comms",
                    "clients={clients},comms={comms},method={label}")
    assert got == [("clients=5,comms=4,method=fedma", ["a", "b"])]
