"""Side-by-side speed: fedfuse's in-process engine, fedfuse on Flower, and a plain Flower app.

Workload (the engine benchmark's, benchmarks/engine_overhead.py): FedAvg, 100 clients × 600 MNIST training
images (client c holds images 600c .. 600c+599), 10 clients per round, 1 local epoch, batch 50, SGD lr 0.05;
models MLP 784-200-200-10 and the McMahan CNN (1,663,370 parameters).  Variants, interleaved (every repeat runs
every variant once, so machine noise hits all alike) in this one process tree:

- ``fedfuse-<executor>``: ``fedfuse.runner.experiment`` with an in-process executor (default: sequential
  and batched; the faster one is "fedfuse" in the ratios);
- ``flower-plain``: a Flower app as Flower's tutorials write one (flwr 1.4x Message API,
  benchmarks/flower_plain_app.py): a ``ServerApp`` running ``flwr.serverapp.strategy.FedAvg.start`` and a
  ``ClientApp`` whose ``@app.train()`` loads the global model from the ``ArrayRecord``, trains with a plain torch
  loop on its partition (cached in the node's process, read once from a tensor file) and replies with the new
  ``ArrayRecord`` and ``num-examples``; run with ``flwr.simulation.run_simulation`` on the Ray backend;
- ``fedfuse-flower``: the same fedfuse run with ``executor=flower`` (fedfuse/flower/, Flower's simulation
  runtime), when this checkout has it.

The order of the variants rotates between repeats; imports and the MNIST cache are warmed before any timing.
Both Flower variants get ``--actors`` Ray actors (1 CPU each; default 1, as the in-process engine uses one core)
and every process ``--threads`` torch threads.  Timing (wall clock, ``time.perf_counter`` in this process):
``t_r`` = end of round r (fedfuse: the engine's round callback; Flower: FedAvg's ``evaluate_fn`` hook, which
does no evaluation); s/round = median of ``t_r - t_{r-1}`` over rounds 2 .. R-1 (the first round carries
warm-up, fedfuse's last round its one evaluation); start-up = ``t_1 - launch - s/round`` (config, data,
model, Ray and actor start); total = launch → return; end-to-end for N rounds = total + (N - R) × s/round.

    python benchmarks/peers.py [--data-dir ../shared/data] [--models mlp,cnn] [--rounds 6] [--repeats 2]
        [--e2e-rounds 100] [--variants fedfuse-sequential,fedfuse-batched,flower-plain,fedfuse-flower]
        [--actors 1] [--threads 1] [--quick]

``--quick`` (< 2 minutes): MLP only, 4 rounds, 1 repeat.  ``--deploy [--nodes 2] [--node-poll 0.1]``: a deployed
round instead, fedfuse vs plain Flower on a loopback federation (benchmarks/peers_deploy.py).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from machine import load  # benchmarks/ is on sys.path when a benchmark runs

N_CLIENTS, PER_CLIENT, PER_ROUND, EPOCHS, BATCH, LR = 100, 600, 10, 1, 50, 0.05
MODELS = {  # variant -> (label, fedfuse registry model, options)
    "mlp": ("MLP 784-200-200-10", "mlp", {"widths": [200, 200]}),
    "cnn": ("McMahan CNN", "cnn", {}),
}
DEFAULT_VARIANTS = "fedfuse-sequential,fedfuse-batched,flower-plain,fedfuse-flower"
QUIET_RAY = {"logging_level": logging.ERROR, "log_to_driver": False, "include_dashboard": False}


def quiet_flower() -> None:
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_plain_flower(kind: str, rounds: int, actors: int) -> Timing:
    """The plain Flower app (benchmarks/flower_plain_app.py) in Flower's simulation runtime."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:  # the Ray actors import the app module by name
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, paths)])
    from flower_plain_app import app, make_server_app
    from flwr.simulation import run_simulation

    quiet_flower()
    stamps: list[float] = []
    launch = time.perf_counter()
    run_simulation(make_server_app(kind, rounds, stamps), app, num_supernodes=N_CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": actors, **QUIET_RAY}})
    end = time.perf_counter()
    if len(stamps) != rounds:
        raise RuntimeError(f"plain Flower finished {len(stamps)} of {rounds} rounds")
    return Timing(launch, stamps, end)


# --------------------------------------------------------------------------------------------- fedfuse


def fedfuse_config(model: str, opts: dict, rounds: int, executor: str, data_dir: str, threads: int) -> Any:
    from fedfuse.config import RunConfig, apply, validate

    return validate(apply(RunConfig(), dict(
        algorithm="fedavg", dataset="mnist", data_dir=data_dir, partition="contiguous", val_fraction=0.0,
        model=model, model_options=opts, clients=N_CLIENTS, clients_per_round=PER_ROUND, rounds=rounds,
        local_epochs=EPOCHS, batch_size=BATCH, lr=LR, eval_every=10_000, plots=False, device="cpu",
        executor=executor, threads=threads, seed=0,
    )))


def run_fedfuse(model: str, opts: dict, rounds: int, executor: str, data_dir: str, threads: int,
                actors: int = 1) -> Timing:
    """A whole fedfuse run (config, MNIST from the data dir, contiguous 100 × 600 partition, model, rounds);
    ``executor="flower"`` with ``actors`` Ray actors."""
    from fedfuse.runner import experiment

    stamps: list[float] = []
    launch = time.perf_counter()
    cfg = fedfuse_config(model, opts, rounds, executor, data_dir, threads)
    ex = None
    if executor == "flower":  # as make_executor builds it, with the actor count of the plain Flower app
        from fedfuse.flower.simulation import SimulationExecutor

        ex = SimulationExecutor(cfg, cfg.seed, num_nodes=N_CLIENTS, workers=actors, threads=threads)
    exp = experiment(cfg, executor=ex, on_round=lambda rec: stamps.append(time.perf_counter()))
    exp.run()
    end = time.perf_counter()
    acc = exp.history[-1].get("global_accuracy")
    return Timing(launch, stamps, end, accuracy=None if acc is None else float(acc))


def flower_executor_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("flwr") is not None


# ---------------------------------------------------------------------------------------------- timing


@dataclass
class Timing:
    launch: float
    stamps: list[float]  # end of each round
    end: float
    accuracy: float | None = None

    def rounds(self) -> list[float]:
        ends = [self.launch, *self.stamps]
        return [b - a for a, b in itertools.pairwise(ends)]

    def steady(self) -> list[float]:
        """Round times without the first (warm-up) and, with >= 3 rounds, the last (fedfuse evaluates there)."""
        r = self.rounds()
        return r[1:-1] if len(r) >= 3 else r[1:]


@dataclass
class Row:
    steady: list[float] = field(default_factory=list)
    startup: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)

    def add(self, t: Timing) -> None:
        per = statistics.median(t.steady())
        self.steady.extend(t.steady())
        self.startup.append(t.stamps[0] - t.launch - per)
        self.totals.append(t.end - t.launch)
        self.rounds.append(len(t.stamps))
        if t.accuracy is not None:
            self.accuracy.append(t.accuracy)

    def per_round(self) -> float:
        return statistics.median(self.steady)

    def e2e(self, n: int) -> float:
        """Median measured total, plus the rounds not run at the median round time."""
        return statistics.median(self.totals) + (n - statistics.median(self.rounds)) * self.per_round()


def prepare(data_dir: str, path: Path, threads: int) -> None:
    """Imports and caches every variant needs (so no variant pays them for the others): fedfuse's modules and
    MNIST cache, Flower's simulation modules; then the 60,000 normalised training tensors for the plain Flower
    nodes."""
    import flwr.simulation  # noqa: F401

    import fedfuse.runner
    from fedfuse.data.datasets import load_dataset

    if flower_executor_available():
        import fedfuse.flower.app  # noqa: F401
    fedfuse_config("mlp", {}, 3, "sequential", data_dir, threads)
    ds = load_dataset("mnist", data_dir)
    n = N_CLIENTS * PER_CLIENT
    torch.save((ds.train_x[:n].contiguous(), ds.train_y[:n].contiguous()), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    shared = next((d / "shared" / "data" for d in root.parents if (d / "shared" / "data" / "mnist").is_dir()), None)
    p.add_argument("--data-dir", default=os.environ.get("FEDFUSE_DATA") or (str(shared) if shared else None),
                   help="directory with mnist/ (default: $FEDFUSE_DATA, else the nearest shared/data above)")
    p.add_argument("--models", default="mlp,cnn", help="which of mlp,cnn")
    p.add_argument("--rounds", type=int, default=6, help="rounds per run (>= 3)")
    p.add_argument("--repeats", type=int, default=2, help="runs of every variant, interleaved")
    p.add_argument("--e2e-rounds", type=int, default=100, help="rounds of the end-to-end column")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--actors", type=int, default=1, help="Ray actors (CPUs) of the Flower simulations")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    p.add_argument("--quick", action="store_true", help="< 2 minutes: MLP, 4 rounds, 1 repeat")
    p.add_argument("--deploy", action="store_true",
                   help="measure a deployed round instead (SuperLink + --nodes SuperNodes on loopback, TLS; "
                        "benchmarks/peers_deploy.py)")
    p.add_argument("--nodes", type=int, default=2, help="--deploy: SuperNodes (= clients, all train every round)")
    p.add_argument("--node-poll", type=float, default=None,
                   help="--deploy: also run *-warm-poll variants, SuperNodes polling every S s instead of 3 s")
    p.add_argument("--deploy-variants", default="fedfuse-warm,plain-warm,fedfuse-warm-poll,plain-warm-poll,"
                                                "fedfuse-cold,plain-cold")
    args = p.parse_args()
    if args.deploy:
        import peers_deploy

        torch.set_num_threads(args.threads)
        peers_deploy.main(args)
        return
    if args.quick:
        args.models, args.rounds, args.repeats = "mlp", 4, 1
    if args.rounds < 3:
        p.error("--rounds must be >= 3 (the first and last rounds are not timed)")
    torch.set_num_threads(args.threads)
    os.environ["PEERS_THREADS"] = str(args.threads)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    variants = [v for v in args.variants.split(",") if v]
    if "fedfuse-flower" in variants and not flower_executor_available():
        print("fedfuse-flower: skipped, this checkout has no executor 'flower' (fedfuse/flower/)")
        variants.remove("fedfuse-flower")
    import flwr

    tmp = Path(tempfile.mkdtemp(prefix="peers-"))
    os.environ["PEERS_DATA"] = str(tmp / "mnist-100x600.pt")
    prepare(args.data_dir, tmp / "mnist-100x600.pt", args.threads)
    print(f"start: {load()}")
    print(f"{os.cpu_count()} cores; torch {torch.__version__}, flwr {flwr.__version__}; threads {args.threads}, "
          f"Flower actors {args.actors}; {args.rounds} rounds × {args.repeats} repeats; real MNIST")
    for kind in [m for m in args.models.split(",") if m]:
        label, model, opts = MODELS[kind]
        rows = {v: Row() for v in variants}
        for rep in range(args.repeats):  # interleaved; the order rotates so no variant always goes first
            for v in variants[rep % len(variants):] + variants[: rep % len(variants)]:
                if v == "flower-plain":
                    t = run_plain_flower(kind, args.rounds, args.actors)
                elif v == "fedfuse-flower":
                    t = run_fedfuse(model, opts, args.rounds, "flower", args.data_dir, args.threads, args.actors)
                else:
                    t = run_fedfuse(model, opts, args.rounds, v.removeprefix("fedfuse-"), args.data_dir,
                                    args.threads)
                rows[v].add(t)
        print(f"\n{label} (after it: {load()})")
        n = args.e2e_rounds
        print(f"| variant | s/round | start-up s | total s ({args.rounds} rounds) | end-to-end s ({n} rounds) | "
              "final accuracy |")
        print("|---|---|---|---|---|---|")
        for v, r in rows.items():
            acc = f"{statistics.median(r.accuracy):.4f}" if r.accuracy else "—"
            print(f"| {v} | {r.per_round():.3f} | {statistics.median(r.startup):.2f} | "
                  f"{statistics.median(r.totals):.2f} | {r.e2e(n):.1f} | {acc} |")
        own = [v for v in rows if v in ("fedfuse-sequential", "fedfuse-batched", "fedfuse-auto")]
        if own and "flower-plain" in rows:
            best = min(own, key=lambda v: rows[v].per_round())
            fl = rows["flower-plain"]
            print(f"\nfastest in-process fedfuse: {best}")
            print(f"- {best} vs plain Flower: {fl.per_round() / rows[best].per_round():.2f}× per round, "
                  f"{fl.e2e(n) / rows[best].e2e(n):.2f}× end to end ({n} rounds, start-up included)")
            if "fedfuse-flower" in rows:
                ff = rows["fedfuse-flower"]
                print(f"- fedfuse-flower / plain Flower: {ff.per_round() / fl.per_round():.2f}× s/round, "
                      f"{ff.e2e(n) / fl.e2e(n):.2f}× end to end (< 1 = fedfuse-flower faster)")
    print(f"\nend: {load()}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
