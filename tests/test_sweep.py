"""Sweeps (sweep.py): seeds, grids, the run store (cache + resume), parallel = serial."""

import json

import pytest

from fedfuse.config import ConfigError
from fedfuse.engine.loop import strip_timing
from fedfuse.sweep import Sweep, expand_grid, load_sweep, parse_grid

SMALL = dict(dataset="digits", rounds=2, clients=4, clients_per_round=2, model="mlp",
             model_options={"widths": [8]}, threads=1, plots=False)


def test_parse_and_expand_grid():
    g = parse_grid(["lr=0.01,0.05", "mu=0.1,0.25", "widths=[64],[128,128]"])
    assert g == {"lr": [0.01, 0.05], "mu": [0.1, 0.25], "widths": [[64], [128, 128]]}
    pts = expand_grid({"lr": [1, 2], "mu": [3, 4, 5]})
    assert len(pts) == 6 and pts[0] == {"lr": 1, "mu": 3} and pts[1] == {"lr": 1, "mu": 4}
    assert expand_grid(None) == [{}]
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        parse_grid(["lr"])


def test_plan_applies_grid_keys_only_where_they_exist():
    sw = Sweep.plan(["fedavg", "fedprox"], seeds=2, grid={"mu": [0.1, 0.5], "lr": [0.05]}, **SMALL)
    labels = [p.label for p in sw.points]
    assert labels == ["fedavg lr=0.05", "fedprox mu=0.1 lr=0.05", "fedprox mu=0.5 lr=0.05"]
    assert [p.config.algorithm_options.get("mu") for p in sw.points] == [None, 0.1, 0.5]
    assert len(sw.configs()) == 6 and [c.seed for _, c in sw.configs()] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ConfigError, match=r"mu is an option of fedprox.*not of fedavg"):
        Sweep.plan(["fedavg"], grid={"mu": [0.1]}, **SMALL)
    with pytest.raises(ConfigError, match=r"no algorithm among fedavg, local has this option; did you mean mu\? "
                                          r"It is an option of fedprox"):
        Sweep.plan(["fedavg", "local"], grid={"muu": [0.1]}, **SMALL)


def test_plan_options_apply_where_they_exist_and_algo_prefix_to_one():
    """The API's options mean what ``--set`` means: bare → every algorithm that has it, ALGO.opt → that one."""
    sw = Sweep.plan(["fedavg", "FedProx", "heterofl"], mu=0.2, **{"heterofl.mu": 0.4}, **SMALL)
    assert [p.config.algorithm for p in sw.points] == ["fedavg", "fedprox", "heterofl"]
    assert [p.config.algorithm_options.get("mu") for p in sw.points] == [None, 0.2, 0.4]
    sw = Sweep.plan(["fedavg", "fedprox"], grid={"fedprox.mu": [0.1, 0.3]}, **SMALL)
    assert [p.label for p in sw.points] == ["fedavg", "fedprox mu=0.1", "fedprox mu=0.3"]
    with pytest.raises(ConfigError, match="mu: no algorithm among fedavg, local has this option"):
        Sweep.plan(["fedavg", "local"], mu=0.1, **SMALL)
    with pytest.raises(ConfigError, match="not among the algorithms"):
        Sweep.plan(["fedavg"], per_algorithm={"fedprox": {"mu": 1}}, **SMALL)
    with pytest.raises(ConfigError, match="rounds: expected an integer"):
        Sweep.plan(["fedavg"], grid={"rounds": ["x"]}, **SMALL)


def _records(table):
    return {(label, r.seed): [strip_timing(h) for h in r.history] for label, rs in table.results.items() for r in rs}


def test_store_caches_extends_and_resumes(tmp_path):
    store = tmp_path / "store"
    first = Sweep.plan(["fedavg", "fedprox"], seeds=1, per_algorithm={"fedprox": {"mu": 0.1}}, **SMALL)
    first.execute(store=store, out=tmp_path / "a")
    assert len(list(store.iterdir())) == 2
    ext = Sweep.plan(["fedavg", "fedprox"], seeds=2, per_algorithm={"fedprox": {"mu": 0.1}}, **SMALL)
    ext.execute(store=store, out=tmp_path / "b")
    cached = {(label, r.seed): r.cached for label, rs in ext.results.items() for r in rs}
    assert cached == {("fedavg", 0): True, ("fedprox", 0): True, ("fedavg", 1): False, ("fedprox", 1): False}
    assert len(list(store.iterdir())) == 4
    meta = json.loads((tmp_path / "b" / "sweep.json").read_text())
    assert meta["labels"] == ["fedavg", "fedprox"] and len(meta["runs"]) == 4
    # an interrupted run (checkpoint, no summary) resumes and ends identical to the uninterrupted one
    victim = ext.results["fedprox"][1].out
    (victim / "summary.json").unlink()
    again = Sweep.plan(["fedavg", "fedprox"], seeds=2, per_algorithm={"fedprox": {"mu": 0.1}}, **SMALL)
    again.execute(store=store)
    assert [r.cached for r in again.results["fedprox"]] == [True, False]
    assert _records(again.table()) == _records(ext.table())
    assert set(load_sweep(tmp_path / "b")) == {"fedavg", "fedprox"}


def test_parallel_jobs_give_the_same_metrics_as_serial(tmp_path):
    kw = dict(seeds=[1], per_algorithm={"fedprox": {"mu": 0.1}}, **SMALL)
    serial = Sweep.plan(["fedavg", "fedprox"], **kw).execute(store=tmp_path / "s").table()
    parallel = Sweep.plan(["fedavg", "fedprox"], **kw).execute(store=tmp_path / "p", jobs=2).table()
    assert _records(parallel) == _records(serial)
    assert all(not r.cached and r.out.parent == tmp_path / "p" for rs in parallel.results.values() for r in rs)


def test_grid_over_algorithms_points_to_compare():
    from fedfuse.config import ConfigError
    from fedfuse.sweep import Sweep

    with pytest.raises(ConfigError, match="compare --algorithms"):
        Sweep.plan(None, grid={"algorithm": ["fedavg", "clusamp"]}, seeds=[0])
