"""FedMR (Hu et al.) Table 1, scaled to a CPU: real CIFAR-10 (100 clients, 10 per round; Dir(0.1), Dir(0.5),
IID) and LEAF FEMNIST (natural writer partition) with FedMR's small CNN, comparing FedAvg, FedProx, FedMut,
FedExP, FedASAM, FedMR (no warm-up) and two-stage FedMR.

Paper settings kept: SGD lr 0.01, momentum 0.9, batch 50, 10 % participation, FedProx μ = 0.01 (CIFAR-10) /
0.1 (FEMNIST).  Changed to fit ≤ 60 min on 2 free CPU cores (one torch thread): 1 local epoch instead of 5
and 60 rounds (``--rounds``, ``--local-epochs``); the two-stage variant warms up for half of the rounds; the
global model is evaluated every 10 rounds.  ``--quick`` runs only CIFAR-10 Dir(0.5) for 10 rounds.
Writes ``results.json``, ``table.md`` (updated after every run) and one curve plot per setting into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from fedfuse.reproduce.common import markdown, pct, run_one

DESCRIPTION = "FedMR Table 1 (scaled): CIFAR-10 Dir(0.1)/Dir(0.5)/IID + FEMNIST, FedMR vs 5 baselines"

METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("FedAvg", "fedavg", {}),
    ("FedProx", "fedprox", {}),  # mu set per dataset
    ("FedMut", "fedmut", {}),
    ("FedExP", "fedexp", {}),
    ("FedASAM", "fedasam", {}),
    ("FedMR", "fedmr", {}),
    ("FedMR two-stage", "fedmr", {"warmup_rounds": -1}),  # -1: half of the rounds
    ("FedGen", "fedgen", {}),  # server generator settings of the FedGen code (the paper says it reused them)
    ("CluSamp", "clusamp", {}),  # clustered sampling by gradient similarity (Fraboni et al. Alg. 2)
]

PAPER_DIRECTION = (
    "FedMR best on every row of the paper's Table 1 (e.g. ResNet-20, CIFAR-10, Dir(0.1): 58.40 % vs FedMut 50.75 %)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=0, help="override the number of rounds")
    p.add_argument("--local-epochs", type=int, default=1, help="paper: 5")
    p.add_argument("--warmup", type=int, default=-1, help="two-stage warm-up rounds (-1 = half of the rounds)")
    p.add_argument("--settings", default="", help="comma list among cifar10-dir0.1,femnist,cifar10-dir0.5,cifar10-iid")
    p.add_argument("--methods", default="", help="comma list of method labels to run (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for this CNN)")
    p.add_argument("--seed", type=int, default=0)


def settings(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], float]]:
    """(name, config overrides, FedProx mu) per data setting."""
    cifar = dict(dataset="cifar10", clients=100, clients_per_round=10)
    femnist = dict(dataset="femnist", partition="natural", clients=105, clients_per_round=10)
    all_ = [
        ("cifar10-dir0.1", {**cifar, "partition": "dirichlet", "partition_options": {"alpha": 0.1}}, 0.01),
        ("femnist", femnist, 0.1),
        ("cifar10-dir0.5", {**cifar, "partition": "dirichlet", "partition_options": {"alpha": 0.5}}, 0.01),
        ("cifar10-iid", {**cifar, "partition": "iid"}, 0.01),
    ]
    wanted = [s for s in args.settings.split(",") if s]
    if not wanted:
        wanted = ["cifar10-dir0.5"] if args.quick else [s[0] for s in all_]
    return [s for s in all_ if s[0] in wanted]


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, args.threads))
    data_dir = getattr(args, "data_dir", None) or os.environ.get("FEDFUSE_DATA") or "../shared/data"
    args.quick = bool(getattr(args, "quick", False))
    rounds = args.rounds or (10 if args.quick else 60)
    eval_every = 5 if args.quick else 10
    warm = args.warmup if args.warmup >= 0 else rounds // 2
    out = Path(getattr(args, "out", None) or ("runs/reproduce-fedmr" + ("-quick" if args.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    base = dict(
        model="cnn-cifar", rounds=rounds, local_epochs=args.local_epochs, batch_size=50, lr=0.01, momentum=0.9,
        eval_every=eval_every, checkpoint_every=rounds, data_dir=data_dir, seed=args.seed, plots=False,
    )
    labels = [m for m in args.methods.split(",") if m]
    results: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    t_all = time.perf_counter()
    for sname, sopts, mu in settings(args):
        curves[sname] = {}
        for label, algo, opts in METHODS:
            if labels and label not in labels:
                continue
            opts = dict(opts)
            if algo == "fedprox":
                opts["mu"] = mu
            if opts.get("warmup_rounds") == -1:
                opts["warmup_rounds"] = warm
            t0 = time.perf_counter()
            summary, history = run_one(
                {**base, **sopts, "algorithm": algo, "algorithm_options": opts},
                out / sname / label.replace(" ", "-").lower(), progress=False,
            )
            evals = [h for h in history if h.get("global_accuracy") is not None]
            curves[sname][label] = [(h["round"], h["global_accuracy"]) for h in evals]
            last3 = [h["global_accuracy"] for h in evals[-3:]]
            row = {
                "setting": sname, "method": label, "algorithm": algo, "options": opts,
                "final_acc": pct(summary["final"].get("global_accuracy")),
                "last3_mean_acc": pct(sum(last3) / len(last3)) if last3 else None,
                "best_acc": pct(max((h["global_accuracy"] for h in evals), default=None)),
                "personal_acc": pct(summary["final"].get("personal_accuracy")),
                "model_cosine": evals[-1].get("model_cosine") if evals else None,
                "MB_up": summary["totals"]["bytes_up"] / 1e6, "MB_peer": summary["totals"]["bytes_peer"] / 1e6,
                "seconds": round(time.perf_counter() - t0, 1),
            }
            results.append(row)
            print(f"[fedmr] {sname:15s} {label:16s} final {row['final_acc']}%  ({row['seconds']} s)", flush=True)
            _write(out, results, curves, rounds, warm, args, time.perf_counter() - t_all)
    print((out / "table.md").read_text())
    return 0


def _write(out: Path, results: list[dict], curves: dict, rounds: int, warm: int, args, wall: float) -> None:
    (out / "results.json").write_text(json.dumps({"results": results, "curves": curves}, indent=1))
    names = [m[0] for m in METHODS]
    table = []
    for s in dict.fromkeys(r["setting"] for r in results):
        row: dict[str, Any] = {"setting": s}
        for n in names:
            hit = [r for r in results if r["setting"] == s and r["method"] == n]
            if hit:
                row[n] = f"{hit[0]['final_acc']:.2f} ({hit[0]['last3_mean_acc']:.2f})"
        table.append(row)
    text = [
        f"Global test accuracy (%) after {rounds} rounds: final (mean of the last 3 evaluations). cnn-cifar, "
        f"{args.local_epochs} local epoch(s), batch 50, SGD lr 0.01 momentum 0.9, 10 clients per round, "
        f"two-stage warm-up {warm} rounds, seed {args.seed}. Wall time so far {wall / 60:.1f} min.",
        "",
        markdown(table),
        "",
        f"Paper direction: {PAPER_DIRECTION}.",
        "",
        "Curves (global accuracy % at each evaluation):",
        "",
    ]
    for s, per in curves.items():
        if not per:
            continue
        rounds_axis = [r for r, _ in next(iter(per.values()))]
        crow = [{"method": m, **{f"r{r}": round(100 * a, 1) for r, a in pts}} for m, pts in per.items()]
        text += [f"**{s}** (rounds {rounds_axis[0]}..{rounds_axis[-1]})", "", markdown(crow), ""]
        _plot(out / f"curves-{s}.png", s, per)
    (out / "table.md").write_text("\n".join(text))


def _plot(path: Path, title: str, per: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, pts in per.items():
        if pts:
            r, a = zip(*pts)
            ax.plot(r, [100 * x for x in a], marker="o", ms=3, label=m)
    ax.set_xlabel("round")
    ax.set_ylabel("global test accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
