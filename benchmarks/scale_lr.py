"""The shared local learning rate of a benchmark scale, chosen on the clients' validation splits (docs/benchmark.md,
*Datasets, models and budget*).

    python benchmarks/scale_lr.py --data-dir ../shared/data --scale cifar10 --regime dir0.5 \
        --rounds 40 --lrs 0.02,0.05,0.1,0.2

FedAvg runs the cell's config (:func:`fedfuse.benchmark.cell_config`, seed 0) for ``--rounds`` rounds at each
learning rate; printed (JSON, one line per rate): the validation accuracy and loss of the last evaluation (the
size-weighted mean over the clients' validation splits, never the test split).  The scale's ``lr`` is the rate
with the highest validation accuracy; every method of the scale then trains with it.
"""

from __future__ import annotations

import argparse
import json

from fedfuse.benchmark import REGIMES, SCALES, cell_config
from fedfuse.config import RunConfig, apply
from fedfuse.runner import experiment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--scale", default="cifar10", choices=[s for s in SCALES if s != "quick"])
    p.add_argument("--regime", default="dir0.5", choices=list(REGIMES))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--lrs", default="0.02,0.05,0.1,0.2")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    for lr in (float(x) for x in a.lrs.split(",")):
        d = cell_config(SCALES[a.scale], a.regime, "fedavg", a.data_dir)
        d.update(rounds=a.rounds, seed=0, out=None, lr=lr)
        last = experiment(apply(RunConfig(), d)).run()["last"]
        print(json.dumps({"scale": a.scale, "regime": a.regime, "rounds": a.rounds, "lr": lr,
                          "val_accuracy": round(last["val_accuracy"], 4), "val_loss": round(last["val_loss"], 4)}),
              flush=True)


if __name__ == "__main__":
    main()
