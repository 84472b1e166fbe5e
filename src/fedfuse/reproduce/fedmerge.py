"""FedMerge (seed papers 000/001) against FedAvg, IFCA and FedEM, over several seeds.

Parts (``--parts``, default ``mnist,cifar``):

* ``mnist`` — the defaults check: MNIST, ``label-cluster`` (5 clusters × 2 classes), 20 clients, 5 per round, the
  MLP, 15 rounds, every other setting the run's default (lr 0.1, 2 local epochs, batch 32); FedAvg, IFCA (K = 5)
  and FedMerge with its shipped defaults at d ∈ {2, 5, 10, 20} (quick: d ∈ {5, 10}); the full preset adds the
  non-default forms (shared initialisation, paper Θ update, the previous defaults) and FedEM as rows.
* ``cifar`` — the papers' comparison on real CIFAR-10 images, two non-IID settings over 20 clients (10 per round):
  *cluster* (5 clusters of 2 classes, client groups of sizes 2-6, the papers' Cluster non-IID scaled down) and
  *personal* (Dirichlet(0.1)); FedMR's CIFAR CNN (62k parameters).  The papers use CIFAR-100, ResNet-9, 50 clients
  and 500 rounds; the same presets run at that scale on a GPU with ``--rounds`` and a larger ``train_limit``.

Every cell is the mean ± sample std over the seeds (``--seeds``, default 3) of the *final* personalised accuracy
(each client's model on its own test split, averaged over clients); "ordering" rows compare FedMerge d = 5 with
each baseline on the same seeds (paired t-test: ``*`` p < 0.05, ``(n.s.)`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from fedfuse.reproduce.common import run_seeds
from fedfuse.stats import mean_std, paired_test, parse_seeds
from fedfuse.tables import markdown

DESCRIPTION = "FedMerge vs FedAvg/IFCA/FedEM over seeds: MNIST label-cluster (defaults check) and CIFAR-10 cluster/Dir"

PARTITIONS: dict[str, dict[str, Any]] = {
    "mnist-cluster": {"partition": "label-cluster", "partition_options": {"clusters": 5}},
    "cluster": {"partition": "label-cluster",
                "partition_options": {"clusters": 5, "group_sizes": [2, 3, 4, 5, 6]}},
    "personal": {"partition": "dirichlet", "partition_options": {"alpha": 0.1}},
}

PAPER = {  # CIFAR-100, ResNet-9, 50 clients, 500 rounds (FedMerge paper, Tables 2-4); d = 5 unless noted
    ("cluster", "local"): "23.13", ("cluster", "fedavg"): "29.20", ("cluster", "fedavg-ft"): "46.53",
    ("cluster", "pfedmoe"): "49.03", ("cluster", "ifca"): "42.64", ("cluster", "fedem"): "48.47",
    ("cluster", "fedmerge d=5"): "51.69", ("cluster", "fedmerge d=10"): "51.38",
    ("cluster", "fixed 1/5"): "32.55 (1/15)",
    ("personal", "local"): "38.76", ("personal", "fedavg"): "30.29", ("personal", "fedavg-ft"): "53.54",
    ("personal", "pfedmoe"): "54.28", ("personal", "ifca"): "25.68", ("personal", "fedem"): "32.50",
    ("personal", "fedmerge d=5"): "37.88", ("personal", "fedmerge d=10"): "46.62",
    ("personal", "fixed 1/5"): "40.94 (1/15)",
}
BASELINES = ("fedavg", "ifca", "fedem")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="mnist,cifar", help="comma list of mnist, cifar")
    p.add_argument("--partitions", default="cluster,personal", help="CIFAR settings: comma list of cluster, personal")
    p.add_argument("--methods", default="", help="comma list of row labels to run (default: all of the preset)")
    p.add_argument("--rounds", type=int, default=0, help="override the number of rounds (both parts)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"mnist_rounds": 15, "mnist_train": 6000, "mnist_test": 2000,
                "rounds": 8, "train_limit": 4000, "test_limit": 2000, "eval_every": 4}
    return {"mnist_rounds": 15, "mnist_train": 12000, "mnist_test": 4000,
            "rounds": 24, "train_limit": 10000, "test_limit": 5000, "eval_every": 3}


def mnist_methods(quick: bool) -> list[tuple[str, str, dict[str, Any]]]:
    rows = [("fedavg", "fedavg", {}), ("ifca", "ifca", {"k": 5}),
            ("fedmerge d=5", "fedmerge", {"d": 5}), ("fedmerge d=10", "fedmerge", {"d": 10})]
    if not quick:
        rows += [("fedmerge d=2", "fedmerge", {"d": 2}), ("fedmerge d=20", "fedmerge", {"d": 20}),
                 ("fedmerge d=10 shared init", "fedmerge", {"d": 10, "init": "shared"}),
                 ("fedmerge d=20 shared init", "fedmerge", {"d": 20, "init": "shared"}),
                 ("fedmerge d=10 paper Θ", "fedmerge", {"d": 10, "theta_update": "paper"}),
                 ("fedmerge d=10 previous defaults", "fedmerge",
                  {"d": 10, "theta_update": "paper", "merge_step": 0.01}),
                 ("fedem", "fedem", {"m": 5})]
    return rows


def cifar_methods(quick: bool, eval_every: int, rounds: int) -> list[tuple[str, str, dict[str, Any]]]:
    fm = {"heatmap_every": eval_every * max(rounds // (4 * eval_every), 1)}
    rows = [("fedmerge d=5", "fedmerge", {"d": 5, **fm}), ("fedavg", "fedavg", {}), ("ifca", "ifca", {"k": 5}),
            ("fedem", "fedem", {"m": 5})]
    if not quick:
        code = {"theta_update": "column_normalised", "weights_first": True, "prox_mu": 0.01}
        rows += [("fedmerge d=2", "fedmerge", {"d": 2, **fm}), ("fedmerge d=10", "fedmerge", {"d": 10, **fm}),
                 ("fixed 1/5", "fedmerge", {"d": 5, "fixed_k": 1, **fm}),
                 ("fedmerge d=5 code-form", "fedmerge", {"d": 5, **fm, **code}),
                 ("fedmerge d=5 shared init", "fedmerge", {"d": 5, "init": "shared", **fm}),
                 ("fedmerge d=5 paper Θ", "fedmerge", {"d": 5, "theta_update": "paper", **fm}),
                 ("local", "local", {}), ("fedavg-ft", "fedavg-ft", {"ft_epochs": 1}), ("pfedmoe", "pfedmoe", {})]
    return rows


def final_personal(run: tuple[dict, list[dict]]) -> float | None:
    return run[0]["final"].get("personal_accuracy")


def cell_row(setting: str, label: str, runs: list[tuple[dict, list[dict]]], seeds: list[int], cpr: int,
             wall: float) -> dict[str, Any]:
    accs = [final_personal(r) for r in runs]
    aris = [r[1][-1].get("ari") for r in runs if r[1]]
    tot = [r[0]["totals"] for r in runs]
    rounds = max(runs[0][0].get("rounds_completed", 1), 1)
    return {
        "setting": setting, "method": label,
        "personal acc % (mean ± std)": mean_std(accs).fmt(100.0),
        "per seed": " / ".join("—" if a is None else f"{100 * a:.1f}" for a in accs),
        "paper %": PAPER.get((setting, label)),
        "ARI": mean_std(aris).fmt(1.0, 2) if any(a is not None for a in aris) else None,
        "KB/client/round": round(sum((t["bytes_down"] + t["bytes_up"]) for t in tot) / len(tot)
                                 / max(rounds * cpr, 1) / 1024, 1),
        "seeds": ",".join(map(str, seeds)), "wall s": round(wall, 1),
        "_acc": accs,
    }


def ordering(rows: list[dict[str, Any]], methods: tuple[str, ...] = ("fedmerge d=5", "fedmerge d=10")) -> list[dict]:
    """Each FedMerge row of ``methods`` vs each baseline on the same seeds, per setting (paired t-test)."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        by = {r["method"]: r for r in rows if r["setting"] == setting}
        for m in (m for m in methods if m in by):
            for b in (b for b in BASELINES if b in by):
                t = paired_test(by[m]["_acc"], by[b]["_acc"])
                verdict = "yes" if t.diff > 0 else "no"
                out.append({"setting": setting, "comparison": f"{m} vs {b}",
                            "difference (points)": round(100 * t.diff, 2) if t.n else None,
                            "p (paired t)": None if t.p_value != t.p_value else round(t.p_value, 4),
                            "paper ordering holds": verdict + ("" if t.significant() else " (n.s.)")})
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(int(args.threads), 1))
    s = settings(args.quick)
    seeds = parse_seeds(args.seeds)
    out = Path(args.out or ("runs/reproduce-fedmerge" + ("-quick" if args.quick else "")))
    data_dir = args.data_dir or os.environ.get("FEDFUSE_DATA", "../shared/data")
    out.mkdir(parents=True, exist_ok=True)
    wanted = {m.strip() for m in args.methods.split(",") if m.strip()}
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()

    def show(rs: list[dict[str, Any]]) -> str:
        return markdown([{k: v for k, v in r.items() if not k.startswith("_")} for r in rs])

    def write() -> str:
        text = (f"# FedMerge reproduction ({'quick' if args.quick else 'full'}), seeds {','.join(map(str, seeds))}\n\n"
                f"{show(rows)}\n\n## Paper ordering (FedMerge d=5 and d=10 vs baselines, same seeds)\n\n"
                f"{markdown(ordering(rows))}\n\nwall {time.perf_counter() - t_all:.0f} s\n")
        (out / "results.md").write_text(text)
        (out / "results.json").write_text(json.dumps(rows, indent=2, default=str))
        return text

    def cell(setting: str, label: str, base: dict[str, Any], algo: str, opts: dict[str, Any], cpr: int) -> None:
        if wanted and label not in wanted:
            return
        t0 = time.perf_counter()
        run_dir = out / setting / label.replace(" ", "_").replace("/", "-").replace("Θ", "theta").replace(",", "")
        runs = run_seeds(base, run_dir, seeds, progress=False, algorithm=algo, algorithm_options=opts)
        rows.append(cell_row(setting, label, runs, seeds, cpr, time.perf_counter() - t0))
        print(show([rows[-1]]).splitlines()[-1], flush=True)
        write()

    if "mnist" in parts:
        base = {
            "dataset": "mnist", "data_dir": data_dir, "model": "mlp", "clients": 20, "clients_per_round": 5,
            "rounds": args.rounds or s["mnist_rounds"], "plots": False, "checkpoint_every": 10_000,
            "eval_every": 5, "threads": args.threads, **PARTITIONS["mnist-cluster"],
            "dataset_options": {"train_limit": s["mnist_train"], "test_limit": s["mnist_test"]},
        }
        for label, algo, opts in mnist_methods(args.quick):
            cell("mnist-cluster", label, base, algo, opts, 5)
    if "cifar" in parts:
        rounds = args.rounds or s["rounds"]
        base = {
            "dataset": "cifar10", "data_dir": data_dir, "model": "cnn-cifar", "clients": 20, "clients_per_round": 10,
            "rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "eval_every": s["eval_every"],
            "plots": False, "checkpoint_every": 10_000, "threads": args.threads,
            "dataset_options": {"train_limit": s["train_limit"], "test_limit": s["test_limit"]},
        }
        for pname in [p.strip() for p in args.partitions.split(",") if p.strip()]:
            if pname not in ("cluster", "personal"):
                raise SystemExit(f"unknown partition {pname!r}; choose cluster or personal")
            for label, algo, opts in cifar_methods(args.quick, s["eval_every"], rounds):
                cell(pname, label, {**base, **PARTITIONS[pname]}, algo, opts, 10)
    print(write())
    return 0
