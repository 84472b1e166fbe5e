"""Engine benchmark: fedfuse's executors vs a hand-written PyTorch FedAvg loop and the hardware floor.

Setting: FedAvg, 100 clients × 600 MNIST-shaped samples, 10 clients per round, 1 local epoch, batch 50,
SGD lr 0.05; models MLP 784-200-200-10 and the McMahan CNN.  In this one process, interleaved (every repeat
runs every variant once, so machine noise hits all alike), on the same data:

- ``plain``: a minimal hand-written loop (one client after another, ``torch.optim.SGD``);
- ``floor``: the same 6,000 samples trained centrally in one model with batch 600 (10 steps a round) —
  what the hardware does with the work of a round when nothing is per-client;
- ``sequential`` / ``batched`` / ``processes`` / ``auto``: fedfuse's round loop with that executor.

Reported: median wall seconds per round (first round — FLOP counting, the auto probe, worker start — and
the last, evaluation round excluded), samples per second, speed-up over ``plain`` (> 1 = faster), median
CPU seconds per round of *this* process and the CPU-time ratio over ``plain`` (on a loaded machine the CPU
time is the more reliable measure of in-process work; worker processes' CPU is not in it, so the
``processes`` row shows wall time only).

``--algorithms fedprox,fedmr,...`` adds a table: each algorithm with the sequential and the batched executor on
the MLP (speed-up = sequential / batched).

    python benchmarks/engine_overhead.py [--data-dir ../shared/data] [--rounds 6] [--repeats 3] [--threads 1]
        [--models mlp,cnn,mlp-small] [--executors sequential,batched,processes,auto] [--workers 2]
        [--algorithms fedprox,fedmr,fedmerge,heterofl]

With ``--data-dir`` the real MNIST training images are used (first 60,000 split into 100 × 600);
otherwise random MNIST-shaped tensors (the timing does not depend on the pixel values).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.executors import make_executor
from fedfuse.engine.processes import ProcessExecutor
from fedfuse.models import build_model
from fedfuse.rng import numpy_rng
from fedfuse.runner import experiment
from fedfuse.types import ClientData, Federation, Split

N_CLIENTS, PER_CLIENT, PER_ROUND, BATCH, LR = 100, 600, 10, 50, 0.05
FLOOR_BATCH = 600


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


def engine_round_times(fed: Federation, model: str, opts: dict, rounds: int, executor: str, *,
                       algorithm: str = "fedavg", workers: int = 2, threads: int = 1) -> tuple[list, list]:
    """(wall, CPU) seconds of every timed round of the engine with ``executor``."""
    cfg = apply(RunConfig(), dict(
        algorithm=algorithm, dataset="mnist", model=model, model_options=opts, clients=N_CLIENTS,
        clients_per_round=PER_ROUND, rounds=rounds + 2, local_epochs=1, batch_size=BATCH, lr=LR,
        eval_every=10_000, plots=False, partition="iid", device="cpu", executor=executor,
    ))
    ex = (ProcessExecutor(fed.clients, cfg.seed, workers=workers, threads=threads) if executor == "processes"
          else make_executor(executor, fed.clients, cfg.seed, threads=threads))
    cpu: list[float] = []
    last = [time.process_time()]

    def tick(rec: dict) -> None:
        now = time.process_time()
        cpu.append(now - last[0])
        last[0] = now

    exp = experiment(cfg, fed=fed, executor=ex, on_round=tick)
    last[0] = time.process_time()
    exp.run()
    return [h["seconds"] for h in exp.history[1:-1]], cpu[1:-1]


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def plain_round_times(fed: Federation, model_name: str, opts: dict, rounds: int) -> tuple[list, list]:
    torch.manual_seed(0)
    model = build_model(model_name, (1, 28, 28), 10, **opts)
    state = {"g": {k: v.clone() for k, v in model.state_dict().items()}}
    walls, cpus = [], []
    for r in range(rounds + 1):

        def one_round(r: int = r) -> None:
            chosen = numpy_rng(0, "plain", r).choice(N_CLIENTS, size=PER_ROUND, replace=False)
            states, weights = [], []
            for c in chosen:
                data = fed.clients[int(c)].train
                model.load_state_dict(state["g"])
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
            state["g"] = {k: sum(s[k] * (w / total) for s, w in zip(states, weights)) for k in states[0]}

        w, c = _timed(one_round)
        walls.append(w)
        cpus.append(c)
    return walls[1:], cpus[1:]


def floor_round_times(fed: Federation, model_name: str, opts: dict, rounds: int) -> tuple[list, list]:
    """The round's 6,000 samples trained centrally in one model, batch 600 (the hardware floor)."""
    torch.manual_seed(0)
    model = build_model(model_name, (1, 28, 28), 10, **opts)
    x = torch.cat([fed.clients[c].train.x for c in range(PER_ROUND)])
    y = torch.cat([fed.clients[c].train.y for c in range(PER_ROUND)])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    walls, cpus = [], []
    for r in range(rounds + 1):

        def one_round(r: int = r) -> None:
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(r))
            for s in range(0, len(x), FLOOR_BATCH):
                idx = perm[s : s + FLOOR_BATCH]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()

        w, c = _timed(one_round)
        walls.append(w)
        cpus.append(c)
    return walls[1:], cpus[1:]


MODELS = {  # variant → (label, registry model, options)
    "mlp": ("MLP 784-200-200-10", "mlp", {"widths": [200, 200]}),
    "cnn": ("McMahan CNN", "cnn", {}),
    "mlp-small": ("MLP 784-32-10", "mlp", {"widths": [32]}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process and of each worker")
    p.add_argument("--models", default="mlp,cnn", help="which of mlp,cnn,mlp-small to time")
    p.add_argument("--executors", default="sequential,batched,processes,auto")
    p.add_argument("--workers", type=int, default=2, help="worker processes of the processes executor")
    p.add_argument("--algorithms", default="", help="also time these algorithms, sequential vs batched, on the MLP")
    p.add_argument("--no-floor", action="store_true", help="skip the hardware-floor variant")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fed = make_federation(args.data_dir)
    executors = [e for e in args.executors.split(",") if e]
    samples = PER_ROUND * PER_CLIENT
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start; "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, data "
          f"{'real MNIST' if args.data_dir else 'random MNIST-shaped'}, {args.rounds} rounds × {args.repeats} "
          f"repeats, processes: {args.workers} workers")
    for variant in [m for m in args.models.split(",") if m]:
        name, m, opts = MODELS[variant]
        variants = ("plain", *(() if args.no_floor else ("floor",)), *executors)
        times: dict[str, tuple[list, list]] = {k: ([], []) for k in variants}
        for _ in range(args.repeats):  # interleaved so machine noise hits every variant alike
            for key in times:
                if key == "plain":
                    w, c = plain_round_times(fed, m, opts, args.rounds)
                elif key == "floor":
                    w, c = floor_round_times(fed, m, opts, args.rounds)
                else:
                    w, c = engine_round_times(fed, m, opts, args.rounds, key, workers=args.workers,
                                              threads=args.threads)
                times[key][0].extend(w)
                times[key][1].extend(c)
        pw, pc = statistics.median(times["plain"][0]), statistics.median(times["plain"][1])
        print(f"\n{name}")
        print("| variant | s/round (wall) | samples/s | speed vs plain (wall) | CPU s/round | speed vs plain (CPU) |")
        print("|---|---|---|---|---|---|")
        for key, (w, c) in times.items():
            mw, mc = statistics.median(w), statistics.median(c)
            cpu_cols = ("n/a (workers)", "n/a") if key == "processes" else (f"{mc:.3f}", f"{pc / mc:.2f}×")
            print(f"| {key} | {mw:.3f} | {samples / mw:,.0f} | {pw / mw:.2f}× | {cpu_cols[0]} | {cpu_cols[1]} |")
    algos = [a for a in args.algorithms.split(",") if a]
    if algos:
        name, _, opts = MODELS["mlp"]
        print(f"\nalgorithms on the {name}: sequential vs batched executor")
        print("| algorithm | sequential s/round | batched s/round | speed-up (wall) | sequential CPU | batched CPU | "
              "speed-up (CPU) |")
        print("|---|---|---|---|---|---|---|")
        for algo in algos:
            res: dict[str, tuple[list, list]] = {"sequential": ([], []), "batched": ([], [])}
            for _ in range(args.repeats):
                for ex in res:
                    w, c = engine_round_times(fed, "mlp", opts, args.rounds, ex, algorithm=algo, threads=args.threads)
                    res[ex][0].extend(w)
                    res[ex][1].extend(c)
            sw, bw = statistics.median(res["sequential"][0]), statistics.median(res["batched"][0])
            sc, bc = statistics.median(res["sequential"][1]), statistics.median(res["batched"][1])
            print(f"| {algo} | {sw:.3f} | {bw:.3f} | {sw / bw:.2f}× | {sc:.3f} | {bc:.3f} | {sc / bc:.2f}× |")


if __name__ == "__main__":
    main()
