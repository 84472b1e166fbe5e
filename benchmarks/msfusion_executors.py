"""MSfusion under the sequential and the batched executor: CPU and wall seconds per run, same final loss.

Setting: MNIST ``shards`` with H = 5 classes per participant, 10 participants (all active), μ = 0.25, MLP
200-200, 2 local epochs, batch 32, lr 0.1, a stratified 6,000-image subset, one evaluation at the end.
Every repeat runs both executors (interleaved); the table gives medians.

    python benchmarks/msfusion_executors.py --data-dir ../shared/data [--rounds 4] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedfuse.config import RunConfig, apply
from fedfuse.runner import experiment


def run(executor: str, data_dir: str, rounds: int, threads: int) -> tuple[float, float, float]:
    cfg = apply(RunConfig(), dict(
        algorithm="msfusion", dataset="mnist", data_dir=data_dir, partition="shards",
        partition_options={"classes_per_client": 5}, model="mlp", clients=10, clients_per_round=10, rounds=rounds,
        eval_every=rounds, local_epochs=2, batch_size=32, lr=0.1, seed=0, plots=False, executor=executor,
        threads=threads, dataset_options={"train_limit": 6000, "test_limit": 500}, algorithm_options={"mu": 0.25}))
    exp = experiment(cfg, progress=False)
    wall, cpu = time.time(), time.process_time()
    exp.run()
    return time.time() - wall, time.process_time() - cpu, float(exp.history[-1]["train_loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    res: dict[str, list[tuple[float, float, float]]] = {"sequential": [], "batched": []}
    for _ in range(args.repeats):
        for ex in res:
            res[ex].append(run(ex, args.data_dir, args.rounds, args.threads))
    print("| executor | wall s/run | CPU s/run | final train loss |")
    print("|---|---|---|---|")
    for ex, rows in res.items():
        wall, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"| {ex} | {wall:.2f} | {cpu:.2f} | {rows[-1][2]:.6f} |")
    s, b = (statistics.median(r[1] for r in res[e]) for e in ("sequential", "batched"))
    print(f"\nbatched vs sequential (CPU): {s / b:.2f}×")


if __name__ == "__main__":
    main()
