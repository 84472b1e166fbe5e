"""The multi-seed tables of ``fedfuse reproduce`` (fedmerge / msfusion presets through
``fedfuse.reproduce.preset``): mean ± std over seeds, per-seed details and the paper ordering verdicts, on
hand-made run histories (no training); the presets' rows and the MSfusion settings."""

import argparse

import pytest

from fedfuse.config import make_config
from fedfuse.reproduce import fedmerge as rf
from fedfuse.reproduce import msfusion as rm
from fedfuse.reproduce.preset import Table, details, ordering, pairs_within, pick, section
from fedfuse.result import Result
from fedfuse.result_table import ResultTable


def fake(seed: int, value: float, key: str = "personal_accuracy", **extra) -> Result:
    hist = [{"round": 1, key: 0.1}, {"round": 2, key: value, **extra}]
    return Result(make_config(seed=seed), hist, {"final": hist[-1]})


def table_of(runs: dict[str, list[float]], key: str, pairs, **kw) -> tuple[Table, ResultTable]:
    t = Table("t", "T", {}, {k: {"algorithm": "fedavg"} for k in runs}, metric=key, pairs=pairs, **kw)
    rt = ResultTable({k: [fake(s, v, key, ari=1.0) for s, v in enumerate(vs)] for k, vs in runs.items()},
                     metric=key, last=1)
    return t, rt


def test_fedmerge_cells_and_ordering():
    rows = {"fedmerge d=5": [0.9, 0.92, 0.94], "fedavg": [0.6, 0.65, 0.61], "ifca": [0.93, 0.95, 0.94]}
    pairs = pairs_within(rows, rf.PAIRS)
    assert pairs == (("fedmerge d=5", "fedavg"), ("fedmerge d=5", "ifca"))  # no FedEM row, no d=10 row: no pair
    t, rt = table_of(rows, "personal_accuracy", pairs, paper={"fedavg": "29.20"}, columns=("ari",))
    assert rt.display_rows()[0]["final personal acc (%)"] == "92.00 ± 2.00"
    d = details(t, rt)
    assert d[0]["personal_accuracy per seed"] == "90.0 / 92.0 / 94.0" and d[0]["ari"] == "1 / 1 / 1"
    assert d[1]["paper"] == "29.20" and d[0]["paper"] == "—" and d[0]["seeds"] == "0,1,2"
    verdicts = {o["comparison"]: o for o in ordering(t, rt)}
    assert verdicts["fedmerge d=5 vs fedavg"]["paper ordering holds"] == "yes"
    assert verdicts["fedmerge d=5 vs fedavg"]["difference"] == pytest.approx(30.0)
    # diffs -3, -3, 0 points: t = -2 / (1.732 / sqrt 3) = -2.0 with 2 dof, p = 0.18
    assert verdicts["fedmerge d=5 vs ifca"]["paper ordering holds"] == "no (n.s.)"
    assert verdicts["fedmerge d=5 vs ifca"]["p (paired t)"] == pytest.approx(0.1835, abs=1e-3)
    assert "Paper ordering (same seeds)" in section(t, rt)


def test_msfusion_ordering_accuracy_and_perplexity():
    acc = {"msfusion": [0.85, 0.86, 0.84], "fedrolex": [0.6, 0.7, 0.65], "heterofl": [0.3, 0.35, 0.4]}
    t, rt = table_of(acc, "global_accuracy", rm.PAIRS, columns=("last10_mean", "best10_mean"))
    assert rt.display_rows()[0]["final global acc (%)"] == "85.00 ± 1.00"
    # two evaluated rounds (0.1, then the final value): one 10-round window holding both
    assert details(t, rt)[0]["last10_mean"] == "47.5 / 48.0 / 47.0" == details(t, rt)[0]["best10_mean"]
    got = {o["comparison"]: o["paper ordering holds"] for o in ordering(t, rt)}
    assert got == {"msfusion vs fedrolex": "yes", "msfusion vs heterofl": "yes", "fedrolex vs heterofl": "yes"}
    ppl = {"msfusion": [50.0, 52.0, 51.0], "fedrolex": [40.0, 41.0, 42.0]}
    t, rt = table_of(ppl, "perplexity", pairs_within(ppl, rm.PTB_PAIRS))
    assert rt.display_rows()[0]["final perplexity"] == "51.00 ± 1.00"
    (o,) = ordering(t, rt)
    assert o["paper ordering holds"] == "no" and o["difference"] == pytest.approx(10.0)  # lower is better


def test_rows_are_picked_by_name_in_the_presets_order():
    rows = rf.mnist_methods(True)
    assert list(rows) == ["fedavg", "ifca", "fedmerge d=5", "fedmerge d=10"]
    assert {"fedmerge d=2", "fedmerge d=20"} <= set(rf.mnist_methods(False))
    assert list(pick(rows, "fedmerge d=5, fedavg")) == ["fedavg", "fedmerge d=5"]
    with pytest.raises(SystemExit, match="choose from"):
        pick(rows, "fedprox")
    assert rm.settings(False)["mnist_mus"] == [0.125, 0.25, 0.5]


def test_msfusion_mnist_check_uses_the_papers_split_on_full_data():
    """The MNIST defaults check uses the paper's H = 5 classes per participant on all of MNIST (quick: a subset)
    and sets no algorithm option but μ; the CIFAR presets keep MSfusion's Eq. 6 defaults (the compressed schedule
    is an ablation row)."""
    base = rm.mnist_base("/data")
    assert base["partition"] == "shards" and base["partition_options"] == {"classes_per_client": 5}
    assert base["dataset_options"] == {} and base["model"] == "mlp"
    assert rm.mnist_base("/data", quick=True)["dataset_options"] == {"train_limit": 6000, "test_limit": 2000}
    assert rm.mnist_base("/data", classes=2)["partition_options"] == {"classes_per_client": 2}
    p = argparse.ArgumentParser()
    rm.add_arguments(p)
    assert p.parse_args([]).mnist_classes == 5
    opts = rm.algo_options("msfusion", 0.25, 4, 8)
    assert "schedule_rounds" not in opts and "update_every" not in opts
    assert rm.compressed_eq6(100) == {"schedule_rounds": 0, "update_every": 2}
    assert ("compressed Eq. 6", {"compressed": True}) in rm.ABLATIONS
    assert rm.ablation_rows("") == rm.ABLATIONS
    assert rm.ablation_rows("w/o con, compressed Eq. 6") == (("w/o con", {"contrastive": False}),
                                                             ("compressed Eq. 6", {"compressed": True}))
    with pytest.raises(SystemExit, match="choose from"):
        rm.ablation_rows("w/o everything")


def _planned(module, *flags: str) -> dict[str, dict[str, object]]:
    """Every planned config of a family by (table id, row label), seed 0."""
    from fedfuse.cli import make_parser

    args = make_parser().parse_args(["reproduce", module, "--data-dir", "/data", *flags])
    fam = {"fedmerge": rf, "msfusion": rm}[module].FAMILY
    return {(t.id, label): cfg for t in fam.tables(args) for label, cfg in t.plan([0]).configs()}


def test_fedmerge_quick_cifar_is_the_full_table_resized():
    """``--quick`` keeps the CIFAR tables' shape (splits, model, clients, data per client, methods) and changes only
    the stated sizes: 16 rounds of 5 of the 20 clients (each client still sampled 16 * 5 / 20 = 4 times, as at 8
    rounds of 10), 2 local epochs at lr 0.1, one evaluation at the end, 4,000 images; the full preset is unchanged."""
    full, quick = _planned("fedmerge"), _planned("fedmerge", "--quick")
    cifar_q = {k: c for k, c in quick.items() if c.dataset == "cifar10"}
    assert {t for t, _ in cifar_q} == {"cluster", "personal"} and set(cifar_q) <= set(full)
    for key, q in cifar_q.items():
        f = full[key]
        assert (q.algorithm, q.algorithm_options.get("d"), q.partition, q.partition_options, q.model, q.clients,
                q.batch_size) == (f.algorithm, f.algorithm_options.get("d"), f.partition, f.partition_options,
                                  f.model, f.clients, f.batch_size)
        assert (f.rounds, f.clients_per_round, f.local_epochs, f.lr, f.eval_every) == (24, 10, 1, 0.05, 3)
        limits = ("train_limit", "test_limit")
        assert [f.dataset_options[k] for k in limits] == [10000, 5000]
        assert (q.rounds, q.clients_per_round, q.local_epochs, q.lr, q.eval_every) == (16, 5, 2, 0.1, 16)
        assert [q.dataset_options[k] for k in limits] == [4000, 2000]
        assert q.rounds * q.clients_per_round / q.clients == 4  # samplings per client, as before
    mnist_q = [c for c in quick.values() if c.dataset == "mnist"]  # the MNIST part is not resized
    assert mnist_q and all((c.rounds, c.clients_per_round, c.lr) == (15, 5, 0.1) for c in mnist_q)


def test_msfusion_quick_cifar_is_the_full_table_resized():
    """``--quick`` runs the full preset's non-IID μ = 0.25 CIFAR table with the same model, data, participants,
    batch and schedule, resized to 4 rounds of 2 local epochs with one evaluation at the end; the full preset keeps
    8 rounds of 1 epoch, evaluated every 4."""
    full, quick = _planned("msfusion"), _planned("msfusion", "--quick")
    cifar_q = {k: c for k, c in quick.items() if c.dataset == "cifar10"}
    assert {t for t, _ in cifar_q} == {"cifar-non-iid-mu0.25"} and set(cifar_q) <= set(full)
    for key, q in cifar_q.items():
        f = full[key]
        same = ("algorithm", "partition", "partition_options", "model", "model_options", "clients",
                "clients_per_round", "batch_size", "lr", "dataset_options")
        assert all(getattr(q, k) == getattr(f, k) for k in same), key
        assert {k: v for k, v in q.algorithm_options.items() if k != "stats_every"} == \
            {k: v for k, v in f.algorithm_options.items() if k != "stats_every"}
        assert (f.rounds, f.local_epochs, f.eval_every) == (8, 1, 4)
        assert (q.rounds, q.local_epochs, q.eval_every) == (4, 2, 4)
