"""The benchmark planner: one config per cell, the same model and client data for every method of a regime,
stable cache hashes, methods from the registry, the committed table specs, ``fedfuse bench --quick`` end to end,
and benchmarks/swing_study.py reading the matrix's own runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from fedfuse import benchmark as b
from fedfuse.algorithms import ALGORITHMS
from fedfuse.cached_runs import run_dir_name
from fedfuse.config import config_hash
from fedfuse.reproduce.common import data_root
from fedfuse.verify import verify

ROOT = Path(__file__).resolve().parents[1]


def args(**kw) -> argparse.Namespace:
    base = dict(quick=False, scale="mnist", regimes="", methods="", threads=1, data_dir="/data", seeds="")
    return argparse.Namespace(**{**base, **kw})


def test_one_table_per_regime_and_track_with_every_registered_method_fedavg_first():
    tables = b.tables(args())
    single = [t for t in tables if not t.id.endswith("-width")]
    width = [t for t in tables if t.id.endswith("-width")]
    assert [t.id for t in single] == [f"mnist-{g}" for g in b.SCALES["mnist"].regimes]
    assert [t.id for t in width] == [f"mnist-{g}-width" for g in b.SCALES["mnist"].regimes]
    registered = [m for m in b.SINGLE if m in ALGORITHMS]
    unfit = b.unfit_methods(b.SCALES["mnist"], registered)  # FedBN: the MLP has no BatchNorm
    unfit.update(dict(b.SCALES["mnist"].left_out))  # FedMA: its cost at this scale
    registered = [m for m in registered if m not in unfit]
    for t in single:
        assert next(iter(t.rows)) == "fedavg" and sorted(t.rows) == sorted(registered)
    assert all(next(iter(t.rows)) == "heterofl" and sorted(t.rows) == sorted(b.WIDTH) for t in width)
    assert len(registered) >= 17  # every single-architecture algorithm of the issue


def test_methods_within_a_regime_differ_only_in_the_algorithm():
    """Same model class, data, split, federation, budget and local training for every method of a regime."""
    for t in b.tables(args(regimes="dir0.1,rotated")):
        dicts = [t.config(label).to_dict() for label in t.rows]
        shared = [{k: v for k, v in d.items() if k not in ("algorithm", "algorithm_options")} for d in dicts]
        assert all(s == shared[0] for s in shared)
        assert shared[0]["model"] == "mlp" and shared[0]["dataset"] == "mnist"
        assert [d["algorithm"] for d in dicts] == list(t.rows)
        assert all(d["algorithm_options"] == t.config(d["algorithm"]).algorithm_options for d in dicts)
    rotated = b.tables(args(regimes="rotated", methods="fedavg"))[0].config("fedavg")
    assert rotated.partition == "domain" and rotated.dataset_options["rotate_domains"] == 4


def test_cache_hashes_are_stable_and_name_the_cell():
    """Planning twice gives the same run directories; data location and threads do not change them; regimes,
    methods and seeds do."""
    def names(**kw):
        return [run_dir_name(c) for t in b.tables(args(**kw)) for c in [cfg for _, cfg in t.plan([0, 1]).configs()]]

    first = names(regimes="iid,dir0.5", methods="fedavg,fedprox")
    assert first == names(regimes="iid,dir0.5", methods="fedavg,fedprox")
    assert first == names(regimes="iid,dir0.5", methods="fedavg,fedprox", data_dir="/elsewhere", threads=2)
    assert len(set(first)) == len(first) == 2 * 2 * 2
    t = b.tables(args(regimes="iid", methods="fedavg"))[0]
    assert config_hash(t.config("fedavg")) == config_hash(b.tables(args(regimes="iid", methods="fedavg"))[0]
                                                            .config("fedavg"))


def test_lr_replaces_only_the_shared_rate_and_caches_apart():
    """``--lr`` changes every method's local rate and nothing else of a cell, so its runs get their own cache
    entries; a rate that is not positive is refused."""
    def configs(**kw):
        return {label: t.config(label).to_dict() for t in b.tables(args(regimes="dir0.1", methods="fedavg,scaffold",
                                                                         **kw)) for label in t.rows}

    base, fast = configs(), configs(lr=0.2)
    assert base["fedavg"]["lr"] == b.SCALES["mnist"].training["lr"] and fast["fedavg"]["lr"] == 0.2
    for label in base:
        assert fast[label]["lr"] == 0.2
        rest = {k: v for k, v in fast[label].items() if k != "lr"}
        assert rest == {k: v for k, v in base[label].items() if k != "lr"}
    assert b.tables(args(lr=0.2))[0].title != b.tables(args())[0].title  # the matrix says which rate it ran
    t0, t1 = b.tables(args(regimes="dir0.1", methods="fedavg"))[0], b.tables(args(regimes="dir0.1", methods="fedavg",
                                                                                  lr=0.2))[0]
    assert run_dir_name(t0.config("fedavg")) != run_dir_name(t1.config("fedavg"))
    with pytest.raises(SystemExit, match="--lr"):
        b.tables(args(lr=0.0))


def test_unregistered_methods_are_left_out_with_a_note_and_unknown_ones_rejected(capsys, monkeypatch):
    """A planned method no algorithm is registered under (here: fedbn and moon taken out of the registry) is left
    out with a note; a name the protocol does not plan is an error."""
    import fedfuse.algorithms

    assert b.plan_methods(["fedavg", "fedbn"]) == (["fedavg", "fedbn"], [])  # registered: planned
    for name in ("fedbn", "moon"):
        monkeypatch.delitem(fedfuse.algorithms.ALGORITHMS, name)
    assert b.plan_methods(["fedavg", "fedbn"]) == (["fedavg"], ["fedbn"])
    with pytest.raises(SystemExit, match="unknown"):
        b.plan_methods(["fedavgg"])
    only_width = b.tables(args(methods="heterofl,fedrolex", regimes="iid"))  # no single-track table without rows
    assert [t.id for t in only_width] == ["mnist-iid-width"]
    with pytest.raises(SystemExit, match="regimes"):
        b.tables(args(regimes="natural"))  # MNIST has no writers
    capsys.readouterr()
    b.tables(args(methods="fedavg,moon"))
    assert "left out: moon" in capsys.readouterr().out


def test_the_committed_table_specs_are_the_planner_s():
    for name in ("mnist", "cifar10", "femnist"):
        for track in ("single", "width"):
            spec = b.spec(name, track)
            assert json.loads((ROOT / "results" / "tables" / f"{spec['id']}.json").read_text()) == spec
    assert "<!-- results: bench-mnist -->" in (ROOT / "docs" / "benchmark.md").read_text()


def test_quick_runs_end_to_end_resumes_from_its_cache_and_records(tmp_path, capsys):
    """3 methods × 2 regimes × 2 seeds on the bundled digits; a second invocation runs nothing."""
    from fedfuse.cli import main

    out, root = tmp_path / "out", tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    argv = ["bench", "--quick", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("6 runs: 0 cached, 6 to run") == 2
    matrix = (out / "matrix.md").read_text()
    for m in ("fedavg", "scaffold", "local"):
        assert f"| {m} |" in matrix
    assert "| method | iid | dir0.1 | mean rank |" in matrix and "If your clients look like" in matrix
    assert (out / "figures" / "bench-digits-ranks.png").is_file()
    page = (out / "matrix.html").read_text()
    assert page.count("<table>") == 2 and "figures/bench-digits-ranks.png" in page
    assert main([*argv, "--record", "bench-digits", "--root", str(root)]) == 0
    assert capsys.readouterr().err.count("6 runs: 6 cached, 0 to run") == 2
    recs = [json.loads(p.read_text()) for p in sorted((root / "results" / "records" / "bench-digits").glob("*"))]
    assert len(recs) == 12
    assert {tuple(sorted(r["cell"].items())) for r in recs} == {
        (("dataset", "digits"), ("method", m), ("regime", g), ("track", "single"))
        for m in ("fedavg", "scaffold", "local") for g in ("iid", "dir0.1")}
    assert all(r["costs"] and "personal_accuracy_worst10" in r["metrics"] for r in recs)
    ok, rows = verify(recs[0])  # a recorded cell re-runs to the same numbers, worst-10 % clients included
    assert ok and "personal_accuracy_worst10" in [r[0] for r in rows]
    # --lr at the scale's own rate is the same config (all cached); its records name the rate in their cell
    assert main([*argv, "--lr", "0.05", "--record", "bench-digits-lr", "--root", str(root)]) == 0
    assert capsys.readouterr().err.count("6 runs: 6 cached, 0 to run") == 2
    lr = [json.loads(p.read_text()) for p in sorted((root / "results" / "records" / "bench-digits-lr").glob("*"))]
    assert len(lr) == 12 and all(r["cell"]["lr"] == "0.05" for r in lr)
    assert {r["config_hash"] for r in lr} == {r["config_hash"] for r in recs}


def test_a_diverged_run_is_a_cell_outcome_run_once_and_recorded(tmp_path, capsys, monkeypatch):
    """fedfuse bench goes on past a run that diverges (every client's reply NaN here): the matrix shows the cell
    as diverged, a second invocation loads the outcome instead of running it again, and --record writes it."""
    import dataclasses

    from fedfuse.cli import main

    quick = b.SCALES["quick"]
    bad = {**quick.training, "corrupt": "nan", "corrupt_clients": list(range(quick.clients)), "check_updates": False}
    monkeypatch.setitem(b.SCALES, "quick", dataclasses.replace(quick, training=bad))
    out, root = tmp_path / "out", tmp_path / "repo"
    (root / "results" / "tables").mkdir(parents=True)
    argv = ["bench", "--quick", "--methods", "fedavg", "--regimes", "iid", "--out", str(out), "--no-progress",
            "--record", "bench-digits", "--root", str(root)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("failed: fedavg seed") == 2 and "the run diverged in round 1" in err
    assert "| fedavg | — (2 of 2 diverged) |" in (out / "matrix.md").read_text()
    recs = [json.loads(p.read_text()) for p in sorted((root / "results" / "records" / "bench-digits").glob("*"))]
    assert len(recs) == 2 and all(r["diverged"]["round"] == 1 for r in recs)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "2 runs: 2 cached, 0 to run" in err and err.count("diverged (stored): fedavg seed") == 2


def test_a_method_the_scales_model_cannot_serve_is_left_out_with_its_reason(capsys):
    """FedBN declares it needs BatchNorm layers; the MNIST scale's MLP has none, so FedBN (whose rule would then
    average everything, i.e. be FedAvg) is left out of that matrix with the reason, and the other methods stay."""
    scale = b.SCALES["mnist"]
    assert b.unfit_methods(scale, ["fedavg", "fedbn", "fedper"]) == {
        "fedbn": "it needs a model with BatchNorm layers; mlp has none"}
    capsys.readouterr()
    t = b.tables(args(regimes="iid", methods="fedavg,fedbn,fedper"))
    assert list(t[0].rows) == ["fedavg", "fedper"]
    assert "fedbn left out of the mnist matrix: it needs a model with BatchNorm layers" in capsys.readouterr().out
    # a model with BatchNorm serves it: the rule is the declaration, not a list of names
    bn = b.Scale("cifar10", "vgg16-bn", ("iid",), 4, 2, 1, 1, {}, {}, input_shape=(3, 32, 32))
    assert b.unfit_methods(bn, ["fedbn"]) == {}


def test_a_scales_exclusion_applies_to_the_default_plan_only(capsys):
    """FedMA is left out of the MNIST scale's default plan with its measured reason, and runs when named."""
    assert "fedma" not in b.tables(args(regimes="iid"))[0].rows
    assert "fedma left out of the mnist matrix: its matching costs" in capsys.readouterr().out
    assert list(b.tables(args(regimes="iid", methods="fedavg,fedma"))[0].rows) == ["fedavg", "fedma"]



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


def test_the_study_reuses_the_matrix_runs_and_adds_the_controls(tmp_path, monkeypatch):
    study = _study_module()
    args = argparse.Namespace(scale="quick", regime="dir0.1", methods="fedavg", seeds="0", out=str(tmp_path),
                              data_dir=str(data_root(argparse.Namespace(data_dir=None))), record=None)
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
    # --record: both runs become records, whose rendered swing is the study's
    from fedfuse import records

    monkeypatch.setattr(records, "repo_root", lambda: tmp_path)
    (tmp_path / "results" / "tables").mkdir(parents=True)
    rows = study.study(argparse.Namespace(**{**vars(args), "record": "swing"}))
    recs = records.load_records(tmp_path, "swing")
    assert sorted(r["cell"]["clients_per_round"] for r in recs) == ["10", "5"]
    matrix = next(r for r in recs if r["cell"]["clients_per_round"] == str(b.SCALES["quick"].per_round))
    assert records.curve_value(matrix, {"swing": b.SCALES["quick"].window}) == rows[0]["swing"].mean
