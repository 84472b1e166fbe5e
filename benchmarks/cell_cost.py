"""What one cell of the benchmark matrix costs, to plan a matrix before running it (docs/benchmark.md, *Cost*).

    python benchmarks/cell_cost.py --data-dir ../shared/data --scale cifar10 --regime dir0.5 \
        --methods fedavg,fedem --rounds 10

Each method runs the cell's own config (:func:`fedfuse.benchmark.cell_config`, seed 0, ``--threads 1``) for
``--rounds`` rounds with one evaluation at the end, in this process, one after another.  Printed (JSON, one line
per method): the CPU seconds of the rounds (``cpu_seconds``, the process's CPU time: robust to other work on the
machine), the CPU seconds of the whole run with data loading and start-up, and per round.  A run of the full
budget costs about start-up + rounds × per-round; the evaluations every ``eval_every`` rounds add a little.
"""

from __future__ import annotations

import argparse
import json
import time

from fedfuse.benchmark import REGIMES, SCALES, cell_config
from fedfuse.config import RunConfig, apply
from fedfuse.runner import experiment


def measure(scale: str, regime: str, method: str, rounds: int, data_dir: str) -> dict[str, float | str]:
    """One method's cost at ``rounds`` rounds of the cell (scale, regime)."""
    d = cell_config(SCALES[scale], regime, method, data_dir, threads=1)
    d.update(rounds=rounds, eval_every=rounds, checkpoint_every=rounds, seed=0, out=None)
    c0 = time.process_time()
    summary = experiment(apply(RunConfig(), d)).run()
    total = time.process_time() - c0
    loop = float(summary["totals"]["cpu_seconds"])
    return {"scale": scale, "regime": regime, "method": method, "rounds": rounds,
            "cpu_seconds_rounds": round(loop, 2), "cpu_seconds_total": round(total, 2),
            "cpu_seconds_per_round": round(loop / rounds, 3), "start_up_cpu_seconds": round(total - loop, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--scale", default="mnist", choices=[s for s in SCALES if s != "quick"])
    p.add_argument("--regime", default="dir0.5", choices=list(REGIMES))
    p.add_argument("--methods", default="fedavg")
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    for m in a.methods.split(","):
        print(json.dumps(measure(a.scale, a.regime, m.strip(), a.rounds, a.data_dir)), flush=True)


if __name__ == "__main__":
    main()
