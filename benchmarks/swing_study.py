"""Why an evaluated model swings from one evaluation to the next (docs/benchmark.md, *Which methods swing, and
why*).

    python benchmarks/swing_study.py --data-dir ../shared/data --out runs/bench-mnist \
        --scale mnist --regime dir0.1 --methods fedavg,fedmr,scaffold --seeds 0,1,2

For each method and seed, two runs of the matrix cell (:func:`fedfuse.benchmark.cell_config`):

- the matrix's own run (found in ``--out``/runs, where ``fedfuse bench --out`` keeps it, or run there): 10 of 50
  clients per round;
- a control with **every client in every round** (``clients_per_round = clients``), the rest of the config
  unchanged, run into the same store.

Printed (markdown): the swing of each (the largest change between consecutive evaluations in the headline window,
as the matrix computes it, :func:`fedfuse.bench_report.swing`), and for the matrix run Spearman's correlation,
over every evaluation after the first quarter of the run and pooled over seeds, between how far the accuracy moved
since the previous evaluation and how far the label mix of the clients of the round just before the evaluation is
from the federation's (total-variation distance of the pooled label histograms).  If the swing vanishes with every
client in every round and follows that label distance, it is the sampling of clients under label skew that moves
the evaluated model, not the evaluation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from fedfuse import records
from fedfuse.bench_report import swing
from fedfuse.benchmark import SCALES, cell_config
from fedfuse.cached_runs import run_cached, run_dir_name
from fedfuse.config import RunConfig, apply, validate
from fedfuse.stats import mean_std


def curve(run_dir: Path) -> tuple[str, list[dict[str, Any]]]:
    """(the headline metric, the evaluated round records) of a finished run directory."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in recs if "personal_accuracy" in r]
    metric = "global_accuracy" if evaluated and evaluated[-1].get("global_accuracy") is not None \
        else "personal_accuracy"
    return metric, evaluated


def label_distance(run_dir: Path, clients: list[int]) -> float:
    """Total-variation distance between the pooled label histogram of ``clients`` and the federation's."""
    hist = np.asarray(json.loads((run_dir / "partition.json").read_text())["label_histograms"], dtype=float)
    whole, part = hist.sum(0), hist[clients].sum(0)
    return 0.5 * float(np.abs(part / part.sum() - whole / whole.sum()).sum())


def run(cfg: dict[str, Any], store: Path) -> Path:
    """Run (or find) ``cfg`` in ``store``; its run directory."""
    c = validate(apply(RunConfig(), cfg))  # validated as the matrix's runs are: the same config hash
    c = dataclasses.replace(c, out=str(store / run_dir_name(c)))
    run_cached(c)
    return Path(c.out)


def study(args: argparse.Namespace) -> list[dict[str, Any]]:
    scale = SCALES[args.scale]
    store = Path(args.out) / "runs"
    rows = []
    for method in args.methods.split(","):
        swings, full_swings, moves, dists = [], [], [], []
        for seed in (int(s) for s in args.seeds.split(",")):
            cfg = {**cell_config(scale, args.regime, method, args.data_dir), "seed": seed}
            matrix_dir = run(cfg, store)
            full_dir = run({**cfg, "clients_per_round": scale.clients}, store)
            if args.record:
                for d, per in ((matrix_dir, scale.per_round), (full_dir, scale.clients)):
                    cell = {"regime": args.regime, "method": method, "clients_per_round": str(per)}
                    records.write_record(records.repo_root(), records.make_record(d, args.record, cell))
            metric, evaluated = curve(matrix_dir)
            swings.append(swing({"curve": [[r["round"], r[metric]] for r in evaluated]}, scale.window))
            _, full = curve(full_dir)
            full_swings.append(swing({"curve": [[r["round"], r[metric]] for r in full]}, scale.window))
            later = [r for r in evaluated if r["round"] > scale.rounds // 4]
            for prev, now in itertools.pairwise(later):
                moves.append(abs(now[metric] - prev[metric]))
                dists.append(label_distance(matrix_dir, now["clients"]))
        rho, p = stats.spearmanr(moves, dists)
        rows.append({"method": method, "metric": metric, "swing": mean_std(swings),
                     "swing_full": mean_std(full_swings), "rho": rho, "p": p,
                     "n": len(moves)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True, help="the matrix's output directory (fedfuse bench --out)")
    p.add_argument("--scale", default="mnist", choices=list(SCALES))
    p.add_argument("--regime", default="dir0.1")
    p.add_argument("--methods", default="fedavg")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--record", default=None, metavar="TABLE",
                   help="record both runs of every method and seed into TABLE (cell regime, method, clients_per_round)")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = study(a)
    print(f"{a.scale} {a.regime}: swing (points) with {SCALES[a.scale].per_round} of {SCALES[a.scale].clients} "
          "clients per round (the "
          "matrix) and with every client every round; Spearman ρ of |Δ accuracy| between evaluations vs the "
          "label distance of the round's clients (matrix runs, evaluations after the first quarter)\n")
    print("| method | metric | swing, matrix | swing, every client | ρ | p | n |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['metric']} | {r['swing'].fmt(100, 1)} | {r['swing_full'].fmt(100, 1)} | "
              f"{r['rho']:.2f} | "
              f"{r['p']:.2g} | {r['n']} |")


if __name__ == "__main__":
    main()
