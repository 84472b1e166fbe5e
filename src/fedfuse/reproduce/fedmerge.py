"""FedMerge (seed papers 000/001) and its multi-model baselines on real CIFAR-10 images.

Two non-IID settings over 20 clients: *cluster* (5 disjoint clusters of 2 classes, client groups of sizes
2,3,4,5,6 — the papers' Cluster non-IID scaled down) and *personal* (Dirichlet(0.1)).  Methods: local, fedavg,
fedavg-ft, ifca (K = 5), fedem (M = 5), pfedmoe, fedmerge for d ∈ {2, 5, 10}, the Fixed(1/5) ablation, and
FedMerge d = 5 in the author code's form (column-normalised Θ update, weights first, proximal term 0.01).
One small model (FedMR's CIFAR CNN, 62k parameters) so the full grid fits in about an hour on 2 cores.

Scaled settings (the papers use CIFAR-100, ResNet-9, 50 clients, 500 rounds): the merging step is scaled so
the total logit travel matches the papers' 500 rounds × 0.01 (``merge_step = 5 / rounds``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from fedfuse.reproduce.common import markdown, pct, run_one

DESCRIPTION = "FedMerge vs IFCA/FedEM/pFedMoE/FedAvg(+)/Local on CIFAR-10 (cluster and Dirichlet(0.1) non-IID)"

PARTITIONS: dict[str, dict[str, Any]] = {
    "cluster": {"partition": "label-cluster",
                "partition_options": {"clusters": 5, "group_sizes": [2, 3, 4, 5, 6]}},
    "personal": {"partition": "dirichlet", "partition_options": {"alpha": 0.1}},
}

PAPER = {  # CIFAR-100, ResNet-9, 50 clients, 500 rounds (000 Tables 2-4); d = 5 unless noted
    ("cluster", "local"): "23.13", ("cluster", "fedavg"): "29.20", ("cluster", "fedavg-ft"): "46.53",
    ("cluster", "pfedmoe"): "49.03", ("cluster", "ifca"): "42.64", ("cluster", "fedem"): "48.47",
    ("cluster", "fedmerge d=5"): "51.69", ("cluster", "fedmerge d=10"): "51.38",
    ("cluster", "fixed 1/5"): "32.55 (1/15)",
    ("personal", "local"): "38.76", ("personal", "fedavg"): "30.29", ("personal", "fedavg-ft"): "53.54",
    ("personal", "pfedmoe"): "54.28", ("personal", "ifca"): "25.68", ("personal", "fedem"): "32.50",
    ("personal", "fedmerge d=5"): "37.88", ("personal", "fedmerge d=10"): "46.62",
    ("personal", "fixed 1/5"): "40.94 (1/15)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partitions", default="cluster,personal", help="comma list of cluster, personal")
    p.add_argument("--methods", default="", help="comma list of row labels to run (default: all)")
    p.add_argument("--rounds", type=int, default=0, help="override the number of rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 8, "train_limit": 4000, "test_limit": 2000, "eval_every": 4}
    return {"rounds": 24, "train_limit": 10000, "test_limit": 5000, "eval_every": 3}


def methods(rounds: int, eval_every: int) -> list[tuple[str, str, dict[str, Any]]]:
    step = 5.0 / rounds
    fm = {"merge_step": step, "heatmap_every": eval_every * max(rounds // (4 * eval_every), 1)}
    code = {"theta_update": "column_normalised", "weights_first": True, "prox_mu": 0.01}
    # FedMerge rows first and the costly FedEM last, so a run cut short still has the main comparison
    return [
        ("fedmerge d=5", "fedmerge", {"d": 5, **fm}),
        ("fedavg", "fedavg", {}),
        ("ifca", "ifca", {"k": 5}),
        ("fedmerge d=2", "fedmerge", {"d": 2, **fm}),
        ("fedmerge d=10", "fedmerge", {"d": 10, **fm}),
        ("fixed 1/5", "fedmerge", {"d": 5, "fixed_k": 1, **fm}),
        ("fedmerge d=5 code-form", "fedmerge", {"d": 5, **fm, **code}),
        ("local", "local", {}),
        ("fedavg-ft", "fedavg-ft", {"ft_epochs": 1}),
        ("pfedmoe", "pfedmoe", {}),
        ("fedem", "fedem", {"m": 5}),
    ]


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(int(args.threads), 1))
    s = settings(args.quick)
    rounds = args.rounds or s["rounds"]
    out = Path(args.out or "runs/reproduce-fedmerge")
    data_dir = args.data_dir or os.environ.get("FEDFUSE_DATA", "../shared/data")
    out.mkdir(parents=True, exist_ok=True)
    cpr = 10
    base = {
        "dataset": "cifar10", "data_dir": data_dir, "model": "cnn-cifar", "clients": 20,
        "clients_per_round": cpr, "rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.05,
        "seed": args.seed, "eval_every": s["eval_every"], "plots": False, "checkpoint_every": 10_000,
        "dataset_options": {"train_limit": s["train_limit"], "test_limit": s["test_limit"]},
    }
    wanted = {m.strip() for m in args.methods.split(",") if m.strip()}
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for pname in [p.strip() for p in args.partitions.split(",") if p.strip()]:
        if pname not in PARTITIONS:
            raise SystemExit(f"unknown partition {pname!r}; choose cluster or personal")
        for label, algo, opts in methods(rounds, s["eval_every"]):
            if wanted and label not in wanted:
                continue
            run_dir = out / pname / label.replace(" ", "_").replace("/", "-")
            t0 = time.perf_counter()
            summary, history = run_one({**base, **PARTITIONS[pname]}, run_dir, progress=False,
                                       algorithm=algo, algorithm_options=opts)
            rows.append(row(pname, label, summary, history, rounds, cpr, time.perf_counter() - t0))
            print(markdown([rows[-1]]).splitlines()[-1], flush=True)
            (out / "results_partial.md").write_text(markdown(rows) + "\n")  # survives a run cut short
            heat = run_dir / "merge_weights_final.png"
            if heat.exists():
                shutil.copy(heat, out / f"heatmap_{pname}_{label.replace(' ', '_').replace('/', '-')}.png")
    table = markdown(rows)
    wall = time.perf_counter() - t_all
    text = (f"# FedMerge reproduction ({'quick' if args.quick else 'full'})\n\n"
            f"rounds={rounds}, train_limit={s['train_limit']}, 20 clients, {cpr} per round, cnn-cifar, "
            f"lr 0.05, 1 local epoch, batch 32, seed {args.seed}; wall {wall:.0f} s\n\n{table}\n")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(text)
    return 0


def row(pname: str, label: str, summary: dict, history: list[dict], rounds: int, cpr: int, wall: float) -> dict:
    best, final = summary["best"], summary["final"]
    tot = summary["totals"]
    n_updates = max(rounds * cpr, 1)
    return {
        "setting": pname,
        "method": label,
        "best acc %": pct(best.get("personal_accuracy")),
        "final acc %": pct(final.get("personal_accuracy")),
        "paper %": PAPER.get((pname, label)),
        "KB/client/round": round((tot["bytes_down"] + tot["bytes_up"]) / n_updates / 1024, 1),
        "client params": int(final.get("optimised_parameters_per_client") or 0),
        "server params": int(final.get("server_parameters") or 0),
        "MFLOPs/client/round": round(tot["client_flops"] / n_updates / 1e6, 1),
        "ARI": None if history[-1].get("ari") is None else round(float(history[-1]["ari"]), 3),
        "wall s": round(wall, 1),
    }
