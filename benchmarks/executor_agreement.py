"""How far apart the batched and the sequential executor leave each client after one round.

Both executors run the same client jobs of one round (same payloads, same per-client generators, so the same batch
orders); the script prints, per client, both training losses and the largest parameter difference of the
replies.  Differences come only from floating-point rounding (``vmap`` kernels sum in another order), so how
large they get measures how much the training itself amplifies rounding noise at the given lr and epochs:

    python benchmarks/executor_agreement.py --data-dir ../shared/data --model cnn --lr 0.1 --epochs 2
    python benchmarks/executor_agreement.py --data-dir ../shared/data --model cnn --lr 0.01 --epochs 2
    # MSfusion's seed-1 round 13 (docs/msfusion.md): 12 rounds batched, then round 13 by both executors
    python benchmarks/executor_agreement.py --data-dir ../shared/data --algorithm msfusion --warm-rounds 12 \
        --rounds 20 --option contrastive=false

Setting: MNIST ``shards`` (5 classes per client) on a stratified 6,000-image subset, 10 clients (all in every
round), batch 32.  ``--warm-rounds K`` first runs K whole rounds with the batched executor and compares round
K + 1 from that state (``--rounds`` is the run length the schedules see).
"""

from __future__ import annotations

import argparse

import torch
import yaml

from fedfuse.algorithms.base import RoundInfo
from fedfuse.config import RunConfig, apply
from fedfuse.engine.executor import Job, SequentialExecutor
from fedfuse.runner import experiment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--algorithm", default="fedavg")
    p.add_argument("--model", default="cnn")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warm-rounds", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0, help="run length (default: warm rounds + 1)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="an algorithm option")
    args = p.parse_args()
    options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.option)}
    rounds = max(args.rounds, args.warm_rounds + 1)
    torch.set_num_threads(1)
    cfg = apply(RunConfig(), dict(
        algorithm=args.algorithm, dataset="mnist", data_dir=args.data_dir, model=args.model, clients=args.clients,
        clients_per_round=args.clients, rounds=rounds, batch_size=32, lr=args.lr, seed=args.seed, plots=False,
        executor="batched", threads=1, local_epochs=args.epochs, partition="shards",
        partition_options={"classes_per_client": 5}, dataset_options={"train_limit": 6000, "test_limit": 200},
        algorithm_options=options))
    exp = experiment(cfg, progress=False)
    exp._fresh()
    for r in range(args.warm_rounds):
        exp._round(r)
    r = args.warm_rounds
    clients = list(range(args.clients))
    payloads = exp.algo.configure_fit(exp.state, RoundInfo(index=r, total=rounds), clients)
    jobs = [Job(c, payloads[c], exp.client_states.get(c), ("fit", r, 0)) for c in clients]
    batched = exp.executor.fit(exp.algo, jobs)
    sequential = SequentialExecutor(exp.fed.blinded().clients, cfg.seed).map(exp.algo.fit, jobs)
    print(f"{args.algorithm} {options or ''}, {args.model}, lr {args.lr}, {args.epochs} epoch(s), seed {args.seed}, "
          f"round {r + 1} of {rounds}")
    print("| client | train loss (batched) | train loss (sequential) | max |Δ parameter| |")
    print("|---|---|---|---|")
    for c in clients:
        mb, ms = batched[c][0], sequential[c][0]
        diff = max(((mb.tensors[k].double() - ms.tensors[k].double()).abs().max().item()
                    for k in ms.tensors if ms.tensors[k].is_floating_point() and ms.tensors[k].numel()), default=0.0)
        print(f"| {c} | {mb.stats.train_loss:.7f} | {ms.stats.train_loss:.7f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
