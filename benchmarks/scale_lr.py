"""The shared local learning rate of a benchmark scale, chosen on the clients' validation splits (docs/benchmark.md,
*Datasets, models and budget*).

    python benchmarks/scale_lr.py --data-dir ../shared/data --scale cifar10 --regime dir0.5 \
        --rounds 40 --lrs 0.02,0.05,0.1,0.2 --out runs/lr --record bench-lr

FedAvg runs the cell's config (:func:`fedfuse.benchmark.cell_config`, seed 0) for ``--rounds`` rounds at each
learning rate; printed (JSON, one line per rate): the validation accuracy and loss of the last evaluation (the
size-weighted mean over the clients' validation splits, never the test split).  The scale's ``lr`` is the rate
with the highest validation accuracy; every method of the scale then trains with it.  ``--out`` keeps each run's
directory (``OUT/SCALE-REGIME-lrLR``); ``--record TABLE`` also writes a record of each run (cell ``scale``,
``regime``, ``lr``) under ``results/records/TABLE``, from which docs/benchmark.md renders the choice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    p.add_argument("--out", default=None, help="keep each run's directory under OUT")
    p.add_argument("--record", default=None, metavar="TABLE", help="record each run into TABLE (needs --out)")
    a = p.parse_args()
    if a.record and not a.out:
        p.error("--record needs --out (a record is made from a run directory)")
    import torch

    from fedfuse import records

    torch.set_num_threads(1)
    for lr in (float(x) for x in a.lrs.split(",")):
        d = cell_config(SCALES[a.scale], a.regime, "fedavg", a.data_dir)
        run_dir = Path(a.out) / f"{a.scale}-{a.regime}-lr{lr:g}" if a.out else None
        d.update(rounds=a.rounds, seed=0, out=str(run_dir) if run_dir else None, lr=lr)
        last = experiment(apply(RunConfig(), d)).run()["last"]
        print(json.dumps({"scale": a.scale, "regime": a.regime, "rounds": a.rounds, "lr": lr,
                          "val_accuracy": round(last["val_accuracy"], 4), "val_loss": round(last["val_loss"], 4)}),
              flush=True)
        if a.record:
            cell = {"scale": a.scale, "regime": a.regime, "lr": f"{lr:g}"}
            print(records.write_record(records.repo_root(), records.make_record(run_dir, a.record, cell)))


if __name__ == "__main__":
    main()
