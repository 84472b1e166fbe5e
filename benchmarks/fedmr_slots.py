"""FedMR diagnostics from a finished run's checkpoint: each slot model against the average of the slots.

FedMR evaluates the uniform average of its K slot models (the layer-wise average of the uploads).  This
script loads ``<run>/checkpoint.pt`` and ``<run>/config.yaml`` and prints the global test accuracy of every
slot, of their average, the averaging gain (average − mean slot), and the mean pairwise cosine similarity of
the slots per layer (the paper's Fig. 6 per layer instead of per model):

    python benchmarks/fedmr_slots.py runs/fedmr-cpu120/cifar10-dir0.1/fedmr-p-p2/seed1 --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch

from fedfuse.config import RunConfig, apply, load_yaml
from fedfuse.engine.checkpoint import load_checkpoint
from fedfuse.engine.client import evaluate_model
from fedfuse.fusion.average import weighted_average
from fedfuse.runner import experiment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a FedMR run directory (checkpoint.pt, config.yaml)")
    p.add_argument("--data-dir", default=None, help="override the run's data directory")
    args = p.parse_args()
    torch.set_num_threads(1)
    ck = load_checkpoint(args.run / "checkpoint.pt")  # safe: a tampered file is refused, nothing in it runs
    slots = ck["state"].get("slots")
    if not slots:
        raise SystemExit(f"{args.run}: no FedMR slots in the checkpoint")
    over = {"out": None, "plots": False, **({"data_dir": args.data_dir} if args.data_dir else {})}
    exp = experiment(apply(RunConfig(), {**load_yaml(args.run / "config.yaml"), **over}), progress=False)
    model = exp.ctx.build().to(exp.device)

    def accuracy(state: dict[str, torch.Tensor]) -> float:
        model.load_state_dict(state)
        return 100 * evaluate_model(model, exp.fed.test).accuracy

    accs = [accuracy(s) for s in slots]
    avg = accuracy(weighted_average(slots, [1.0] * len(slots)))
    mean = statistics.mean(accs)
    print(f"{args.run} (after round {ck['round']}, K = {len(slots)})")
    print(f"slot accuracy: {mean:.2f} ± {statistics.stdev(accs):.2f} (min {min(accs):.2f}, max {max(accs):.2f})")
    print(f"average of the slots: {avg:.2f} (averaging gain {avg - mean:+.2f})")
    for layer in model.layers():
        keys = [k for k in layer.keys if slots[0][k].is_floating_point()]
        vecs = [torch.cat([s[k].flatten().double() for k in keys]) for s in slots]
        cos = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in itertools.combinations(vecs, 2)]
        print(f"layer {layer.name}: mean pairwise cosine {statistics.mean(cos):.3f}")


if __name__ == "__main__":
    main()
