"""Engine overhead benchmark: fedfuse's round loop vs a minimal hand-written PyTorch FedAvg loop.

Setting (foundation issue): FedAvg, 100 clients × 600 MNIST-shaped samples, 10 clients per round,
1 local epoch, batch 50, SGD lr 0.05; models MLP 784-200-200-10 and the McMahan CNN.  Both loops run in
this process, interleaved, on the same data; we report the median seconds per round (evaluation rounds
excluded) and samples per second, and the speed ratio plain/engine (≥ 1.0 means no overhead).

    python benchmarks/engine_overhead.py [--data-dir ../shared/data] [--rounds 6] [--repeats 3]

With ``--data-dir`` the real MNIST training images are used (first 60,000 split into 100 × 600);
otherwise random MNIST-shaped tensors (the timing does not depend on the pixel values).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import Experiment
from fedfuse.models import build_model
from fedfuse.rng import numpy_rng
from fedfuse.types import ClientData, Federation, Split

N_CLIENTS, PER_CLIENT, PER_ROUND, BATCH, LR = 100, 600, 10, 50, 0.05


def make_federation(data_dir: str | None) -> Federation:
    if data_dir:
        from fedfuse.data.datasets import load_dataset

        ds = load_dataset("mnist", data_dir)
        x, y = ds.train_x[: N_CLIENTS * PER_CLIENT], ds.train_y[: N_CLIENTS * PER_CLIENT]
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N_CLIENTS * PER_CLIENT, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (N_CLIENTS * PER_CLIENT,), generator=g)
    empty = Split(x[:0], y[:0])
    clients = [
        ClientData(c, Split(x[c * PER_CLIENT : (c + 1) * PER_CLIENT], y[c * PER_CLIENT : (c + 1) * PER_CLIENT]),
                   empty, Split(x[:10], y[:10]))
        for c in range(N_CLIENTS)
    ]
    return Federation(clients, Split(x[:100], y[:100]), 10, (1, 28, 28), dataset="mnist", partition="blocks")


def engine_round_seconds(fed: Federation, model: str, opts: dict, rounds: int) -> list[float]:
    cfg = apply(RunConfig(), dict(
        algorithm="fedavg", dataset="mnist", model=model, model_options=opts, clients=N_CLIENTS,
        clients_per_round=PER_ROUND, rounds=rounds + 1, local_epochs=1, batch_size=BATCH, lr=LR,
        eval_every=10_000, plots=False, partition="iid", device="cpu",
    ))
    exp = Experiment(cfg, fed=fed)
    exp.run()
    return [h["seconds"] for h in exp.history[1:-1]]  # drop the first (FLOP counting) and the last (evaluation)


def plain_round_seconds(fed: Federation, model_name: str, opts: dict, rounds: int) -> list[float]:
    torch.manual_seed(0)
    model = build_model(model_name, (1, 28, 28), 10, **opts)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    times = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        chosen = numpy_rng(0, "plain", r).choice(N_CLIENTS, size=PER_ROUND, replace=False)
        states, weights = [], []
        for c in chosen:
            data = fed.clients[int(c)].train
            model.load_state_dict(global_state)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            gen = torch.Generator().manual_seed(int(c) + 1000 * r)
            perm = torch.randperm(len(data), generator=gen)
            for s in range(0, len(data), BATCH):
                idx = perm[s : s + BATCH]
                loss = torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(len(data))
        total = float(sum(weights))
        global_state = {k: sum(s[k] * (w / total) for s, w in zip(states, weights)) for k in states[0]}
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = PyTorch default)")
    p.add_argument("--models", default="mlp,cnn", help="which of mlp,cnn to time")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fed = make_federation(args.data_dir)
    rows = []
    chosen = set(args.models.split(","))
    for name, model, opts in (("MLP 784-200-200-10", "mlp", {"widths": [200, 200]}), ("McMahan CNN", "cnn", {})):
        if model not in chosen:
            continue
        eng, plain = [], []
        for _ in range(args.repeats):  # interleaved so machine noise hits both alike
            plain += plain_round_seconds(fed, model, opts, args.rounds)
            eng += engine_round_seconds(fed, model, opts, args.rounds)
        e, q = statistics.median(eng), statistics.median(plain)
        samples = PER_ROUND * PER_CLIENT
        rows.append((name, q, samples / q, e, samples / e, q / e))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, data "
          f"{'real MNIST' if args.data_dir else 'random MNIST-shaped'}, {args.rounds} rounds × {args.repeats} repeats")
    print("| model | plain loop s/round | plain samples/s | fedfuse s/round | fedfuse samples/s | speed ratio |")
    print("|---|---|---|---|---|---|")
    for name, q, qs, e, es, ratio in rows:
        print(f"| {name} | {q:.3f} | {qs:,.0f} | {e:.3f} | {es:,.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
