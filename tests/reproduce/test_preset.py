"""Every ``fedfuse reproduce NAME`` preset is data: its tables plan valid run configurations, its paired
comparisons name rows it has, its table ids and row labels are unique, and ``--quick`` is a smaller version of
the same tables.  Checked by planning every preset (no training)."""

from __future__ import annotations

import pytest

from fedfuse.cli import make_parser
from fedfuse.config import RunConfig
from fedfuse.reproduce import available
from fedfuse.reproduce.common import seeds
from fedfuse.reproduce.preset import Table

FAMILIES = sorted(available())
VARIANTS = {  # besides the default and --quick: flags that change which tables a preset plans
    "fedma": [["--part", "oneshot"], ["--comms", "4,20", "--optimizers", "sgd,adam"]],
    "fedmerge": [["--parts", "cifar", "--partitions", "personal"]],
    "fedmerge-lora": [["--sweep"], ["--sweep", "--sweep-methods", "fedem-lora,fedlora"]],
    "fedmr": [["--scale", "full"], ["--scale", "paper"], ["--settings", "mnist-dir0.1,mnist-dir0.5"],
              ["--quick", "--settings", "cifar10-dir0.5"]],
    "msfusion": [["--parts", "ablation,ring"], ["--quick", "--parts", "ptb", "--methods", "msfusion,heterofl"]],
}


def args_of(name: str, *flags: str):
    base = ["--base", "fedfuse:base.pt"] if name == "fedmerge-lora" else []  # else: the pretrained base's path
    return make_parser().parse_args(["reproduce", name, "--data-dir", "/data", *base, *flags])


def cases() -> list[tuple[str, tuple[str, ...]]]:
    out = []
    for name in FAMILIES:
        out += [(name, ()), (name, ("--quick",))] + [(name, tuple(v)) for v in VARIANTS.get(name, [])]
    return out


@pytest.mark.parametrize(("name", "flags"), cases())
def test_every_preset_plans_valid_configs_and_its_pairs_exist(name, flags):
    args = args_of(name, *flags)
    tables = available()[name].tables(args)
    assert tables and all(isinstance(t, Table) for t in tables)
    assert len({t.id for t in tables}) == len(tables), "two tables write to one directory"
    runs = 0
    for t in tables:
        assert t.rows, t.id
        for a, b in t.pairs:  # every paired comparison names two rows of its own table
            assert a in t.rows and b in t.rows and a != b, (t.id, a, b)
        sweep = t.plan(seeds(args))
        assert [p.label for p in sweep.points] == list(t.rows)
        for label, cfg in sweep.configs():
            assert isinstance(cfg, RunConfig) and cfg.seed in seeds(args)
            assert cfg.algorithm == t.rows[label]["algorithm"]
            assert cfg.data_dir == "/data" and cfg.plots is False
            runs += 1
        assert t.metric.endswith(("accuracy", "perplexity"))
    assert runs > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_quick_is_one_seed_of_a_smaller_preset(name):
    full, quick = args_of(name), args_of(name, "--quick")
    assert seeds(full) == [0, 1, 2] and seeds(quick) == [0]
    assert seeds(args_of(name, "--quick", "--seeds", "0,4")) == [0, 4]
    cost = {}
    for key, a in (("full", full), ("quick", quick)):
        cfgs = [cfg for t in available()[name].tables(a) for _, cfg in t.plan([0]).configs()]
        cost[key] = sum(c.rounds * c.clients_per_round for c in cfgs)
    assert cost["quick"] < cost["full"]


def _check_plans_the_records(family: str, table_id: str, count: int, *argv: str) -> None:
    """``fedfuse reproduce FAMILY ARGV`` plans exactly the configurations (config hashes) of the ``count``
    committed records of ``table_id``: each record's hash is a planned run of its method (cell ``method``), seed
    and, where the cell names one, data setting (cell ``setting``: the reproduction's table id)."""
    import json

    from fedfuse.config import apply, config_hash
    from fedfuse.records import repo_root

    args = args_of(family, *argv)
    planned = {config_hash(apply(cfg, {"out": None})): (table.id, label, cfg.seed)
               for table in available()[family].tables(args) for label, cfg in table.plan(seeds(args)).configs()}
    recs = [json.loads(p.read_text()) for p in (repo_root() / "results/records" / table_id).glob("*.json")]
    assert len(recs) == count
    for rec in recs:
        tid, label, seed = planned[rec["config_hash"]]
        assert (label, seed) == (rec["cell"]["method"], rec["seed"]), rec["cell"]
        assert rec["cell"].get("setting", tid) == tid, rec["cell"]


def test_msfusion_plans_the_configs_of_its_committed_records():
    """The records of docs/msfusion.md's 100-round MNIST table were written by
    ``fedfuse reproduce msfusion --quick --parts mnist --mus 0.125 --mnist-rounds 100 --seeds 0,1,2
    --compare-assemblies``: that command still plans exactly their configurations (the same config hashes)."""
    _check_plans_the_records("msfusion", "msfusion-mnist100", 9, "--quick", "--parts", "mnist", "--mus", "0.125",
                             "--mnist-rounds", "100", "--seeds", "0,1,2", "--compare-assemblies", "--threads", "1")


def test_msfusion_plans_the_configs_of_its_committed_cifar_records():
    """The records of docs/msfusion.md's 40-round CIFAR-10 table were written by ``fedfuse reproduce msfusion
    --parts cifar --mus 0.25 --rounds 40 --cifar-splits non-iid --methods msfusion,fedrolex,heterofl --seeds 0,1,2``
    (results/record-msfusion-cifar.sh): that command still plans exactly their configurations."""
    _check_plans_the_records("msfusion", "msfusion-cifar40", 9, "--parts", "cifar", "--mus", "0.25", "--rounds",
                             "40", "--cifar-splits", "non-iid", "--methods", "msfusion,fedrolex,heterofl", "--seeds",
                             "0,1,2", "--threads", "1")


def test_unknown_names_are_errors_that_list_the_choices():
    with pytest.raises(SystemExit, match="choose from"):
        available()["msfusion"].tables(args_of("msfusion", "--parts", "mnist,cifr"))
    with pytest.raises(SystemExit, match="choose from"):
        available()["fedmerge"].tables(args_of("fedmerge", "--partitions", "clusters"))
    with pytest.raises(ValueError, match="choose from"):
        available()["fedmr"].tables(args_of("fedmr", "--methods", "FedFoo"))
    t = Table("t", "t", {}, {"a": {"algorithm": "fedavg"}}, pairs=(("a", "b"),))
    with pytest.raises(ValueError, match="pairs name rows"):
        t.plan([0])


def test_fedmr_plans_the_configs_of_its_committed_records():
    """The records of docs/fedmr.md's tables were written by ``fedfuse reproduce fedmr --scale full`` and by the
    `cpu` preset with ``--settings cifar10-dir0.1`` (every Table 1 method) and ``femnist`` (FedAvg, FedMR)
    (results/record-fedmr.sh): those commands still plan exactly their configurations."""
    _check_plans_the_records("fedmr", "fedmr-full", 6, "--scale", "full", "--seeds", "0,1,2", "--threads", "1")
    _check_plans_the_records("fedmr", "fedmr-cpu", 27, "--settings", "cifar10-dir0.1,femnist",
                             "--methods", "FedAvg,FedMR,FedMR two-stage,FedExP,FedMut,FedProx,FedASAM", "--seeds",
                             "0,1,2", "--threads", "1")
