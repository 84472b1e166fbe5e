"""The Python API: the docs' notebook example, run/load round trips, in-memory runs, discovery and compare."""

import re

import pandas as pd
import pytest

import fedfuse
from fedfuse.api import show
from fedfuse.config import RunConfig
from fedfuse.engine.loop import strip_timing
from fedfuse.result import load
from support import ROOT

DOCS = ROOT / "docs" / "api.md"


SMALL = dict(dataset="digits", rounds=2, clients=4, clients_per_round=2, model="mlp",
             model_options={"widths": [16]}, threads=1)


def test_docs_notebook_example_runs_and_returns_the_metrics(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert blocks, "docs/api.md lost its python example"
    ns: dict = {}
    exec(compile(blocks[0], str(DOCS), "exec"), ns)  # the example exactly as documented
    df = ns["df"]
    assert isinstance(df, pd.DataFrame)
    assert list(df["round"]) == [1, 2, 3]
    for col in ("global_accuracy", "personal_accuracy", "total_bytes", "total_client_flops", "train_loss"):
        assert col in df.columns and df[col].notna().all()
    assert df["global_accuracy"].between(0, 1).all()
    assert (df["total_bytes"].diff().dropna() > 0).all()  # cumulative communication grows
    res = ns["res"]
    assert res.config.algorithm == "fedprox" and res.config.algorithm_options["mu"] == 0.1
    assert df["global_accuracy"].iloc[-1] == pytest.approx(res.summary["last"]["global_accuracy"]) \
        == pytest.approx(res.last["global_accuracy"])
    # 3 evaluations: final = the later half, the last 2, in the summary and the API alike
    assert res.final("global_accuracy") == pytest.approx(df["global_accuracy"].iloc[-2:].mean()) \
        == pytest.approx(res.summary["final"]["global_accuracy"])
    assert res.best("global_accuracy") == df["global_accuracy"].max() == res.summary["best"]["global_accuracy"]
    stats, runs = ns["stats"], ns["runs"]
    assert list(stats.index) == ["fedavg", "fedprox"] and (stats["n"] == 2).all()
    assert len(runs) == 4 and set(runs["seed"]) == {0, 1}
    assert "± " in capsys.readouterr().out


def test_run_writes_artefacts_and_load_round_trips(tmp_path):
    out = tmp_path / "r"
    res = fedfuse.run(algorithm="fedavg", out=str(out), **SMALL)
    assert res.out == out and {"config", "metrics", "summary", "curves", "partition"} <= set(res.artefacts)
    back = load(out)
    assert back.config == res.config
    assert [strip_timing(h) for h in back.history] == [strip_timing(h) for h in res.history]
    pd.testing.assert_frame_equal(back.metrics, res.metrics)
    assert back.summary["final"]["global_accuracy"] == res.summary["final"]["global_accuracy"]
    acc = back.client_accuracy
    assert acc.shape == (2, 4) and list(acc.index) == [1, 2]
    fig = back.plot(path=tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0 and len([a for a in fig.axes if a.get_visible()]) >= 2
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        load(tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # killed in the middle of writing a record
        f.write('{"round": 3, "glob')
    assert len(load(out).history) == 2


def test_run_in_memory_writes_nothing_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = fedfuse.run(algorithm="fedprox", mu=0.1, seed=3, **SMALL)
    b = fedfuse.run({"algorithm": "fedprox", "algorithm_options": {"mu": 0.1}, "seed": 3}, **SMALL)
    assert a.out is None and a.artefacts == {} and list(tmp_path.iterdir()) == []
    assert [strip_timing(h) for h in a.history] == [strip_timing(h) for h in b.history]


def test_discovery_lists_registries_and_show_matches_validation():
    assert "fedprox" in fedfuse.list_algorithms() and "digits" in fedfuse.list_datasets()
    assert fedfuse.algorithms() == fedfuse.list_algorithms() and fedfuse.models() == fedfuse.list_models()
    assert fedfuse.datasets() == fedfuse.list_datasets() and fedfuse.partitions() == fedfuse.list_partitions()
    assert "fedavg" in fedfuse.algorithms.ALGORITHMS  # still the registry package
    assert "cnn" in fedfuse.list_models() and "dirichlet" in fedfuse.list_partitions()
    from fedfuse.algorithms import ALGORITHMS

    for name, cls in ALGORITHMS.items():  # every option a config accepts is shown, with its default
        (comp,) = show(name, "algorithm")
        assert {o.name: o.default for o in comp.options} == cls.option_defaults()
    (cfg,) = show("config")
    assert {o.name for o in cfg.options} == set(RunConfig.__dataclass_fields__)
    assert all(o.help for o in cfg.options if o.name in ("rounds", "lr", "clients"))
    with pytest.raises(KeyError, match="unknown name"):
        show("nothing-like-this")


def test_compare_with_out_writes_the_table_and_reuses_runs(tmp_path):
    kw = dict(seeds=1, out=tmp_path / "c", plots=False, **SMALL)
    t1 = fedfuse.compare(["fedavg", "local"], **kw)
    assert (tmp_path / "c" / "compare.md").read_text().startswith("| label | n |")
    assert t1.metric == "personal_accuracy"  # local has no global model
    t2 = fedfuse.compare(["fedavg", "local"], **kw)
    assert all(r.cached for rs in t2.results.values() for r in rs)
    assert t2.frame()["final_mean"].tolist() == t1.frame()["final_mean"].tolist()
