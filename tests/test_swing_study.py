"""benchmarks/swing_study.py: its label distance by hand, and it reads the matrix's own runs (the same config hash
as ``fedfuse bench``) and adds only the every-client controls."""

from __future__ import annotations

import argparse
import importlib.util
import json

from fedfuse import benchmark as b
from fedfuse.cached_runs import run_dir_name
from fedfuse.reproduce.common import data_root
from support import ROOT


def _study_module():
    spec = importlib.util.spec_from_file_location("swing_study", ROOT / "benchmarks" / "swing_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_label_distance_is_the_total_variation_of_the_pooled_histograms(tmp_path):
    study = _study_module()
    (tmp_path / "partition.json").write_text(json.dumps({"label_histograms": [[10, 0, 0], [0, 10, 10], [5, 5, 0]]}))
    # federation [15, 15, 10]/40; clients 0 and 2 pool [15, 5, 0]/20: TV = ½ (|0.75−0.375| + |0.25−0.375| + 0.25)
    assert study.label_distance(tmp_path, [0, 2]) == 0.5 * (0.375 + 0.125 + 0.25)
    assert study.label_distance(tmp_path, [0, 1, 2]) == 0.0


def test_the_study_reuses_the_matrix_runs_and_adds_the_controls(tmp_path):
    study = _study_module()
    args = argparse.Namespace(scale="quick", regime="dir0.1", methods="fedavg", seeds="0", out=str(tmp_path),
                              data_dir=str(data_root(argparse.Namespace(data_dir=None))))
    rows = study.study(args)
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2 and rows[0]["n"] >= 1
    # one of them is the run `fedfuse bench --quick` plans for that cell and seed
    table = next(t for t in b.tables(argparse.Namespace(quick=True, regimes="dir0.1", methods="fedavg",
                                                        data_dir=args.data_dir, threads=1))
                 if t.id == "digits-dir0.1")
    cfg = table.config("fedavg")
    cfg.seed = 0
    assert run_dir_name(cfg) in runs
    study.study(args)  # a second study runs nothing new
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == runs
