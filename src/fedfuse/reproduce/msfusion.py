"""MSfusion (seed paper 004) vs HeteroFL and FedRolex on real CIFAR-10 images, its ablations, ring vs fully
connected topology, and a transformer LM on Penn Treebank.

Settings follow App. A.2 where they fit the budget: 10 participants, all active every round, 1 local epoch,
plain SGD with a triangular CyclicLR over all rounds, non-IID = 5 classes per participant (``shards``).
Scaled down to fit about an hour on 2 shared cores (the paper: ResNet-18 [64,128,256,512], 500 rounds, batch 10,
lr 0.001-0.0012): ResNet-18 at ``width_mult`` 0.25 (channels [16,32,64,128], static BN), a stratified CIFAR-10
subset of 3,000 images, 8 rounds, batch 32 and a larger learning rate (CyclicLR 0.05-0.1).
Every method uses the same model, data, schedule and rounds.  ``--quick`` runs the non-IID μ = 0.25 comparison
and the PTB MSfusion run only, at fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from fedfuse.config import RunConfig, apply, validate
from fedfuse.engine.loop import Experiment
from fedfuse.reproduce.common import federation_for, markdown, pct, run_one
from fedfuse.types import ClientData, Federation, Split

DESCRIPTION = "MSfusion vs HeteroFL/FedRolex on CIFAR-10 (non-IID/IID, mu sweep, ablations, ring) and PTB"

PAPER_CIFAR = {  # Table 1 (CIFAR-10, ResNet-18, 10 participants); MSfusion rows are at their own mu
    ("heterofl", "non-iid", 0.25): "37.36", ("heterofl", "iid", 0.25): "40.50",
    ("fedrolex", "non-iid", 0.25): "66.41", ("fedrolex", "iid", 0.25): "76.98",
    ("msfusion", "non-iid", 0.1): "71.21", ("msfusion", "iid", 0.1): "78.74",
    ("msfusion", "non-iid", 0.5): "81.91", ("msfusion", "iid", 0.5): "87.37",
}
PAPER_ABLATION = {"msfusion": "75.71", "w/o con": "73.16", "w/o dyn": "73.31", "w/o con & dyn": "70.17"}  # mu=18.75%
PAPER_PTB = {"heterofl": "55.97 (mu=75%)", "fedrolex": "61.52 (mu=75%)", "msfusion": "8.02 (mu=25%)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="",
                   help="comma list of main, ablation, ring, ptb (default: all; quick: main,ptb)")
    p.add_argument("--rounds", type=int, default=0, help="override the CIFAR rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on shared CPUs)")


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 3, "train_limit": 3000, "test_limit": 1000, "eval_every": 3, "ptb_rounds": 2,
                "ptb_seqs": 40, "ptb_test": 200, "grid": [("non-iid", 0.25)]}
    return {"rounds": 8, "train_limit": 3000, "test_limit": 1000, "eval_every": 4, "ptb_rounds": 3,
            "ptb_seqs": 100, "ptb_test": 400,
            "grid": [("non-iid", 0.25), ("non-iid", 0.1), ("non-iid", 0.5), ("iid", 0.25)]}


def cifar_base(s: dict[str, Any], data_dir: str | None, seed: int, partition: str) -> dict[str, Any]:
    part = ({"partition": "shards", "partition_options": {"classes_per_client": 5}} if partition == "non-iid"
            else {"partition": "iid", "partition_options": {}})
    return {
        "dataset": "cifar10", "data_dir": data_dir, **part, "model": "resnet18",
        "model_options": {"width_mult": 0.25, "norm": "bn-static"}, "clients": 10, "clients_per_round": 10,
        "rounds": s["rounds"], "local_epochs": 1, "batch_size": 32, "lr": 0.1, "seed": seed,
        "eval_every": s["eval_every"], "checkpoint_every": 1000, "plots": False, "device": "cpu",
        "dataset_options": {"train_limit": s["train_limit"], "test_limit": s["test_limit"]},
    }


LR = {"lr_schedule": "cyclic", "lr_min_ratio": 0.5}  # with the run's lr 0.1: CyclicLR 0.05 → 0.1


def algo_options(algo: str, mu: float, eval_every: int, rounds: int = 500, **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {"mu": mu, **LR, **extra}
    if algo == "msfusion":  # Eq. 6 every 10 of 500 rounds = 50 updates; scaled: every max(1, R // 50) rounds
        opts.setdefault("update_every", max(1, rounds // 50))
    if algo == "heterofl":
        opts["stats_every"] = eval_every
    return opts


def truncated(fed: Federation, seqs: int, test: int) -> Federation:
    """The first ``seqs`` training windows of every participant (val/test: a quarter of that), and the first
    ``test`` windows of the global test stream: PTB scaled to the CPU budget."""

    def cut(sp: Split, n: int) -> Split:
        return Split(sp.x[:n], sp.y[:n])

    clients = [ClientData(c.cid, cut(c.train, seqs), cut(c.val, max(seqs // 4, 1)), cut(c.test, max(seqs // 4, 1)),
                          c.group) for c in fed.clients]
    return Federation(clients, cut(fed.test, test), fed.num_classes, fed.input_shape, fed.task, fed.dataset,
                      fed.partition, fed.class_names, {**fed.info, "truncated": f"{seqs} train windows/client"})


def row(label: str, summary: dict, history: list[dict], **cols: Any) -> dict[str, Any]:
    fin = summary["final"]
    evals = [h for h in history if h.get("global_accuracy") is not None]
    trained = [h for h in history if h.get("peer_bytes_per_participant") is not None]
    n = summary["clients"]
    rounds = max(summary["rounds_completed"], 1)
    out = {"method": label, **cols,
           "global acc %": pct(fin.get("global_accuracy")),
           "best acc %": pct(max((h["global_accuracy"] for h in evals), default=None)),
           "FLOPs/participant/round": (fin.get("client_flops") or 0) / n / rounds,
           "trained params/participant": history[0].get("optimised_parameters_per_client") if history else None}
    if trained:  # msfusion: protocol bytes = peer exchange
        out["bytes/participant/round"] = (fin.get("bytes_peer") or 0) / n / max(rounds - 1, 1)
        out["full sub-model bytes"] = trained[-1]["full_submodel_bytes_per_participant"]
    else:
        out["bytes/participant/round"] = ((fin.get("bytes_down") or 0) + (fin.get("bytes_up") or 0)) / n / rounds
    out["wall s"] = round(summary["wall_seconds"], 1)
    return out


TITLES = {
    "main": "### CIFAR-10, 10 participants, global full-model accuracy",
    "ablation": "### Ablation, CIFAR-10 non-IID, mu = 0.25",
    "ring": "### Topology, CIFAR-10 non-IID, mu = 0.25 (bytes = peer exchange only)",
    "ptb": "### Penn Treebank, transformer LM, mu = 0.25 (perplexity, lower is better)",
}
ABLATIONS = (("w/o con", {"contrastive": False}), ("w/o dyn", {"dynamic": False}),
             ("w/o con & dyn", {"contrastive": False, "dynamic": False}), ("cosine sim.", {"similarity": "cosine"}))


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(int(getattr(args, "threads", 1)), 1))
    s = settings(args.quick)
    if args.rounds:
        s["rounds"] = args.rounds
    parts = [p.strip() for p in (args.parts or ("main,ptb" if args.quick else "main,ablation,ring,ptb")).split(",")
             if p.strip()]
    out = Path(args.out or ("runs/reproduce-msfusion" + ("-quick" if args.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir or os.environ.get("FEDFUSE_DATA")
    progress = not args.no_progress
    t_start = time.time()
    results: dict[str, list[dict]] = {k: [] for k in TITLES}
    done: dict[tuple, tuple[dict, list[dict]]] = {}  # runs shared between sections

    def write() -> str:
        text = "\n\n".join(f"{TITLES[k]}\n\n{markdown(v)}" for k, v in results.items() if v)
        text += f"\n\nTotal wall time: {time.time() - t_start:.0f} s\n"
        (out / "tables.md").write_text(text)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        return text

    def go(section: str, name: str, base: dict, **over: Any) -> tuple[dict, list[dict]]:
        t = time.time()
        summ, hist = run_one(base, out / section / name, progress=progress, **over)
        print(f"[{section}] {name}: acc={summ['final'].get('global_accuracy')} ppl={summ['final'].get('perplexity')}"
              f" ({time.time() - t:.0f} s)", flush=True)
        return summ, hist

    def main_point(partition: str, mu: float) -> None:
        base = cifar_base(s, data_dir, args.seed, partition)
        for algo in ("msfusion", "fedrolex", "heterofl"):
            summ, hist = go("main", f"{partition}-mu{mu}-{algo}", base, algorithm=algo,
                            algorithm_options=algo_options(algo, mu, s["eval_every"], s["rounds"]))
            done[(algo, partition, mu)] = (summ, hist)
            results["main"].append(row(algo, summ, hist, data=partition, mu=mu,
                                       paper=PAPER_CIFAR.get((algo, partition, mu), "—")))
            write()

    def ablation() -> None:
        base = cifar_base(s, data_dir, args.seed, "non-iid")
        if ("msfusion", "non-iid", 0.25) in done:
            summ, hist = done[("msfusion", "non-iid", 0.25)]
            results["ablation"].append(row("msfusion", summ, hist, mu=0.25, paper="75.71 (mu=18.75%)"))
        for label, extra in ABLATIONS:
            name = label.replace(" ", "").replace("/", "").replace("&", "-").replace(".", "")
            summ, hist = go("ablation", name, base, algorithm="msfusion",
                            algorithm_options=algo_options("msfusion", 0.25, 0, s["rounds"], **extra))
            done[("ablation", label)] = (summ, hist)
            paper = PAPER_ABLATION.get(label)
            results["ablation"].append(row(label, summ, hist, mu=0.25,
                                           paper=f"{paper} (mu=18.75%)" if paper else "—"))
            write()

    def ring() -> None:
        base = cifar_base(s, data_dir, args.seed, "non-iid")
        for topo in ("full", "ring"):
            if topo == "full" and ("msfusion", "non-iid", 0.25) in done:
                summ, hist = done[("msfusion", "non-iid", 0.25)]
            else:
                summ, hist = go("ring", topo, base, algorithm="msfusion",
                                algorithm_options=algo_options("msfusion", 0.25, 0, s["rounds"], topology=topo))
            results["ring"].append(row(f"msfusion ({topo})", summ, hist, mu=0.25))
            write()

    def ptb() -> None:
        base = {
            "dataset": "ptb", "data_dir": data_dir, "partition": "contiguous", "partition_options": {},
            "model": "transformer", "clients": 10, "clients_per_round": 10, "rounds": s["ptb_rounds"],
            "local_epochs": 1, "batch_size": 20, "lr": 1.0, "seed": args.seed, "eval_every": s["ptb_rounds"],
            "checkpoint_every": 1000, "plots": False, "device": "cpu",
            "model_options": {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "dropout": 0.2},
            "dataset_options": {"seq_len": 32},
        }
        for algo in (("msfusion",) if args.quick else ("msfusion", "fedrolex", "heterofl")):
            t = time.time()
            cfg = validate(apply(RunConfig(), {**base, "algorithm": algo, "out": str(out / "ptb" / algo),
                                               "algorithm_options": {"mu": 0.25, "lr_schedule": "cyclic",
                                                                     "lr_min_ratio": 0.5}}))
            exp = Experiment(cfg, fed=truncated(federation_for(cfg), s["ptb_seqs"], s["ptb_test"]),
                             progress=progress)
            summ = exp.run()
            print(f"[ptb] {algo}: ppl={summ['final'].get('perplexity')} ({time.time() - t:.0f} s)", flush=True)
            r = row(algo, summ, exp.history, mu=0.25, paper=PAPER_PTB[algo])
            r["perplexity"] = summ["final"].get("perplexity")
            r.pop("global acc %")
            r.pop("best acc %")
            results["ptb"].append(r)
            write()

    # the core comparison first, then the sections, then the rest of the mu/IID grid (so a run cut short
    # still has one point of every table)
    grid = list(s["grid"])
    if "main" in parts and grid:
        main_point(*grid[0])
    if "ablation" in parts:
        ablation()
    if "ring" in parts:
        ring()
    if "ptb" in parts:
        ptb()
    if "main" in parts:
        for point in grid[1:]:
            main_point(*point)
    print(write())
    return 0
