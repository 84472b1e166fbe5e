"""FedMerge (Chen et al., FedMerge: Federated Personalization via Model Merging; and
FedMerge: Federated Model Merging for Personalization) against FedAvg, IFCA and FedEM, over several seeds.

Parts (``--parts``, default ``mnist,cifar``):

* ``mnist`` — the defaults check: MNIST, ``label-cluster`` (5 clusters × 2 classes), 20 clients, 5 per round, the
  MLP, 15 rounds, every other setting the run's default (lr 0.1, 2 local epochs, batch 32); FedAvg, IFCA (K = 5)
  and FedMerge with its shipped defaults at d ∈ {2, 5, 10, 20} (quick: d ∈ {5, 10}); the full preset adds the
  non-default forms (shared initialisation, paper Θ update, the previous defaults) and FedEM as rows.
* ``cifar`` — the papers' comparison on real CIFAR-10 images, two non-IID settings over 20 clients (10 per round;
  quick 5): *cluster* (5 clusters of 2 classes, client groups of sizes 2-6, the papers' Cluster non-IID scaled down) and
  *personal* (Dirichlet(0.1)); FedMR's CIFAR CNN (62k parameters).  The papers use CIFAR-100, ResNet-9, 50 clients
  and 500 rounds; the same presets run at that scale on a GPU with ``--rounds`` and a larger ``train_limit``.
  Full: 24 rounds, 10,000 images, lr 0.05, 1 local epoch.  Quick-only (``--quick``, a smoke test in which every
  cell learns): 4,000 images, 16 rounds of 5 clients (each client still sampled ~4 times), 2 local epochs at
  lr 0.1, one evaluation at the end; at 8 rounds of 10 clients, 1 epoch, lr 0.05 FedAvg and FedEM sat at chance.
  Measured with ``fedfuse reproduce fedmerge --quick --seeds 0,1,2`` (docs/fedmerge.md, "The quick preset").

Every cell is the mean ± sample std over the seeds (``--seeds``, default 3; quick 1) of the *final* personalised
accuracy (each client's model on its own test split, averaged over clients); "ordering" rows compare FedMerge
d = 5 and d = 10 with each baseline on the same seeds (paired t-test: ``*`` p < 0.05, ``(n.s.)`` otherwise).
"""

from __future__ import annotations

import argparse
from typing import Any

from fedfuse.reproduce.common import data_root
from fedfuse.reproduce.preset import Family, Table, pairs_within, pick

PARTITIONS: dict[str, dict[str, Any]] = {
    "mnist-cluster": {"partition": "label-cluster", "partition_options": {"clusters": 5}},
    "cluster": {"partition": "label-cluster",
                "partition_options": {"clusters": 5, "group_sizes": [2, 3, 4, 5, 6]}},
    "personal": {"partition": "dirichlet", "partition_options": {"alpha": 0.1}},
}

PAPER = {  # CIFAR-100, ResNet-9, 50 clients, 500 rounds (FedMerge paper, Tables 2-4); d = 5 unless noted
    "cluster": {"local": "23.13", "fedavg": "29.20", "fedavg-ft": "46.53", "pfedmoe": "49.03", "ifca": "42.64",
                "fedem": "48.47", "fedmerge d=5": "51.69", "fedmerge d=10": "51.38", "fixed 1/5": "32.55 (1/15)"},
    "personal": {"local": "38.76", "fedavg": "30.29", "fedavg-ft": "53.54", "pfedmoe": "54.28", "ifca": "25.68",
                 "fedem": "32.50", "fedmerge d=5": "37.88", "fedmerge d=10": "46.62", "fixed 1/5": "40.94 (1/15)"},
}
BASELINES = ("fedavg", "ifca", "fedem")
#: The paper's ordering: FedMerge d = 5 and d = 10 above each baseline (tested where both rows run).
PAIRS = tuple((m, b) for m in ("fedmerge d=5", "fedmerge d=10") for b in BASELINES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="mnist,cifar", help="comma list of mnist, cifar")
    p.add_argument("--partitions", default="cluster,personal", help="CIFAR settings: comma list of cluster, personal")
    p.add_argument("--methods", default="", help="comma list of row labels to run (default: all of the preset)")
    p.add_argument("--rounds", type=int, default=0, help="override the number of rounds (both parts)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")


#: The CIFAR part's federation and local training (full preset; ``settings(quick=True)`` overrides some).
CIFAR = {"clients": 20, "clients_per_round": 10, "local_epochs": 1, "batch_size": 32, "lr": 0.05}


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        # CIFAR: the same 20 clients and 4,000 images as before, but 5 per round for 16 rounds (each client is still
        # sampled ~4 times), 2 local epochs at lr 0.1, evaluated once at the end: at 8 rounds of 10 clients, 1
        # epoch, lr 0.05 FedAvg and FedEM sat at chance (docs/fedmerge.md, "Reproduction")
        return {"mnist_rounds": 15, "mnist_train": 6000, "mnist_test": 2000,
                "rounds": 16, "train_limit": 4000, "test_limit": 2000, "eval_every": 16,
                "cifar": {**CIFAR, "clients_per_round": 5, "local_epochs": 2, "lr": 0.1}}
    return {"mnist_rounds": 15, "mnist_train": 12000, "mnist_test": 4000,
            "rounds": 24, "train_limit": 10000, "test_limit": 5000, "eval_every": 3, "cifar": dict(CIFAR)}


def _row(algo: str, **opts: Any) -> dict[str, Any]:
    return {"algorithm": algo, "algorithm_options": opts}


def mnist_methods(quick: bool) -> dict[str, dict[str, Any]]:
    rows = {"fedavg": _row("fedavg"), "ifca": _row("ifca", k=5), "fedmerge d=5": _row("fedmerge", d=5),
            "fedmerge d=10": _row("fedmerge", d=10)}
    if not quick:
        rows |= {"fedmerge d=2": _row("fedmerge", d=2), "fedmerge d=20": _row("fedmerge", d=20),
                 "fedmerge d=10 shared init": _row("fedmerge", d=10, init="shared"),
                 "fedmerge d=20 shared init": _row("fedmerge", d=20, init="shared"),
                 "fedmerge d=10 paper Θ": _row("fedmerge", d=10, theta_update="paper"),
                 "fedmerge d=10 previous defaults": _row("fedmerge", d=10, theta_update="paper", merge_step=0.01),
                 "fedem": _row("fedem", m=5)}
    return rows


def cifar_methods(quick: bool, eval_every: int, rounds: int) -> dict[str, dict[str, Any]]:
    fm = {"heatmap_every": eval_every * max(rounds // (4 * eval_every), 1)}
    rows = {"fedmerge d=5": _row("fedmerge", d=5, **fm), "fedavg": _row("fedavg"), "ifca": _row("ifca", k=5),
            "fedem": _row("fedem", m=5)}
    if not quick:
        code = {"theta_update": "column_normalised", "weights_first": True, "prox_mu": 0.01}
        rows |= {"fedmerge d=2": _row("fedmerge", d=2, **fm), "fedmerge d=10": _row("fedmerge", d=10, **fm),
                 "fixed 1/5": _row("fedmerge", d=5, fixed_k=1, **fm),
                 "fedmerge d=5 code-form": _row("fedmerge", d=5, **fm, **code),
                 "fedmerge d=5 shared init": _row("fedmerge", d=5, init="shared", **fm),
                 "fedmerge d=5 paper Θ": _row("fedmerge", d=5, theta_update="paper", **fm),
                 "local": _row("local"), "fedavg-ft": _row("fedavg-ft", ft_epochs=1), "pfedmoe": _row("pfedmoe")}
    return rows


def _table(tid: str, title: str, base: dict[str, Any], rows: dict[str, Any], wanted: str,
           paper: dict[str, str] | None = None) -> Table | None:
    rows = {k: v for k, v in rows.items() if not wanted or k in wanted.split(",")}
    if not rows:
        return None
    return Table(tid, title, base, rows, metric="personal_accuracy", pairs=pairs_within(rows, PAIRS),
                 paper=paper or {}, columns=("ari",))


def tables(args: argparse.Namespace) -> list[Table]:
    s = settings(args.quick)
    parts = pick({"mnist": 0, "cifar": 0}, args.parts, "--parts")
    settings_ = pick({"cluster": 0, "personal": 0}, args.partitions, "--partitions")
    wanted = ",".join(m.strip() for m in args.methods.split(",") if m.strip())
    common = {"data_dir": data_root(args), "plots": False, "checkpoint_every": 10_000, "threads": args.threads}
    out = []
    if "mnist" in parts:
        base = {**common, "dataset": "mnist", "model": "mlp", "clients": 20, "clients_per_round": 5,
                "rounds": args.rounds or s["mnist_rounds"], "eval_every": 5, **PARTITIONS["mnist-cluster"],
                "dataset_options": {"train_limit": s["mnist_train"], "test_limit": s["mnist_test"]}}
        out.append(_table("mnist-cluster", "MNIST label-cluster (5 × 2 classes), MLP: the defaults check", base,
                          mnist_methods(args.quick), wanted))
    if "cifar" in parts:
        rounds = args.rounds or s["rounds"]
        base = {**common, "dataset": "cifar10", "model": "cnn-cifar", **s["cifar"],
                "rounds": rounds, "eval_every": s["eval_every"],
                "dataset_options": {"train_limit": s["train_limit"], "test_limit": s["test_limit"]}}
        for name in settings_:
            c = s["cifar"]
            out.append(_table(name, f"CIFAR-10 {name} non-IID, {c['clients']} clients ({c['clients_per_round']} "
                              "per round), FedMR's CNN",
                              {**base, **PARTITIONS[name]}, cifar_methods(args.quick, s["eval_every"], rounds),
                              wanted, PAPER[name]))
    return [t for t in out if t is not None]


FAMILY = Family("FedMerge vs FedAvg/IFCA/FedEM over seeds: MNIST label-cluster (defaults check) and CIFAR-10 "
                "cluster/Dir", tables, add_arguments)
