"""Engine benchmark: fedfuse's executors vs a hand-written PyTorch FedAvg loop, against the machine's peak.

Setting: FedAvg, 100 clients × 600 MNIST-shaped samples, 10 clients per round, 1 local epoch, batch 50,
SGD lr 0.05; models MLP 784-200-200-10 and the McMahan CNN.  In this one process, interleaved (every repeat
runs every variant once, so machine noise hits all alike), on the same data:

- ``peak``: the practical peak of one device at each precision: the median GFLOP/s of a large square matrix
  product (``--peak-size``, fp32 and bf16) — the roofline every variant is measured against;
- ``plain``: a minimal hand-written fp32 loop (one client after another, ``torch.optim.SGD``); ``plain-bf16``
  the same loop under bf16 autocast (with the engine's memory-format rule on a CNN);
- ``EXECUTOR/PRECISION``: fedfuse's round loop with that executor and ``precision`` (``--executors`` ×
  ``--precisions``; ``--memory-formats`` adds the CNN's layouts, ``auto`` by default).  ``stacked`` is the
  batched executor with stacked linear layers (``executors/stacked.py``); after the tables the benchmark prints
  which route (stacked, or ``vmap`` and why) each algorithm's groups took.

Reported per variant: median wall seconds per round (first round — FLOP counting, the auto probe, worker
start — and the last, evaluation round excluded), median CPU seconds per round of *this* process, the speed
over ``plain`` in CPU time (on a loaded machine the more reliable measure; wall time for the ``processes``
executor, whose work is in other processes), the achieved GFLOP/s (training FLOPs of the round, from
``torch.utils.flop_counter``, over the CPU seconds; per worker for ``processes``) and the fraction of the peak
of the variant's precision.

``--step`` times only one optimiser step of 10 clients on the MLP (the plain loop's 10 steps against the
stacked executor's one step, no round around it), which separates the step from the engine's round.

``--breakdown`` prints where the MLP's time goes: one step of 10 clients by operator family (products, casts,
optimiser, loss; ``torch.profiler``) for the plain loop and the stacked step, and a stacked round split into
gradients, optimiser, the rest of the group's training and the engine's round around it.

``--algorithms fedprox,fedmr,...`` adds a table: each algorithm with its sequential fp32 run against its fastest
configurations (``--fast``, default the stacked and the batched executor at bf16) on the MLP.

    python benchmarks/engine_overhead.py [--data-dir ../shared/data] [--rounds 6] [--repeats 3] [--threads 1]
        [--models mlp,cnn,mlp-small] [--executors sequential,batched,stacked,processes,auto]
        [--precisions fp32,bf16] [--memory-formats auto,contiguous] [--workers 2]
        [--algorithms fedprox,fedmr,fedmerge,heterofl] [--fast stacked/bf16,batched/bf16] [--all-participants]
        [--gpu] [--gemm] [--step] [--breakdown]

With ``--data-dir`` the real MNIST training images are used (first 60,000 split into 100 × 600);
otherwise random MNIST-shaped tensors (the timing does not depend on the pixel values).  ``--gpu`` runs the
same variants on ``cuda`` (data, models and the peak GEMM on the GPU; times are wall seconds after
``torch.cuda.synchronize``; the process executor is skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fedfuse.config import RunConfig, apply
from fedfuse.engine.client import train_flops_per_sample
from fedfuse.engine.executors import make_executor
from fedfuse.executors.processes import ProcessExecutor
from fedfuse.executors.stacked import StackedExecutor
from fedfuse.models import build_model
from fedfuse.rng import numpy_rng
from fedfuse.runner import experiment
from fedfuse.runtime.precision import train_autocast, train_layout, use_precision
from fedfuse.types import ClientData, Federation, Split

N_CLIENTS, PER_CLIENT, PER_ROUND, BATCH, LR = 100, 600, 10, 50, 0.05
#: algorithms that train every participant every round (no client sampling): the ``--algorithms`` table gives
#: them PER_ROUND participants (MSfusion's paper uses 10), so their round trains as many clients as the others'
#: (``--all-participants`` keeps all N_CLIENTS: 10x the training and, for MSfusion, ~100x the peer exchange)
EVERY_CLIENT_EVERY_ROUND = ("msfusion", "dpsgd")
ROUTES: dict[str, dict[str, int]] = {}  # algorithm → the stacked executor's routes (stacked / vmap: reason)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_federation(data_dir: str | None, device: torch.device) -> Federation:
    if data_dir:
        from fedfuse.data.datasets import load_dataset

        ds = load_dataset("mnist", data_dir)
        x, y = ds.train_x[: N_CLIENTS * PER_CLIENT], ds.train_y[: N_CLIENTS * PER_CLIENT]
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N_CLIENTS * PER_CLIENT, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (N_CLIENTS * PER_CLIENT,), generator=g)
    x, y = x.to(device), y.to(device)
    empty = Split(x[:0], y[:0])
    clients = [
        ClientData(c, Split(x[c * PER_CLIENT : (c + 1) * PER_CLIENT], y[c * PER_CLIENT : (c + 1) * PER_CLIENT]),
                   empty, Split(x[:10], y[:10]))
        for c in range(N_CLIENTS)
    ]
    return Federation(clients, Split(x[:100], y[:100]), 10, (1, 28, 28), dataset="mnist", partition="blocks")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn`` (the device's queue drained before and after)."""
    _sync(device)
    w, c = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - w, time.process_time() - c


def gemm_gflops(m: int, k: int, n: int, precision: str, device: torch.device, repeats: int = 7,
                fp32_matmul: str = "ieee") -> float:
    """Median GFLOP/s of an (``m``×``k``)·(``k``×``n``) product at ``precision`` (CPU time on a CPU, so other jobs
    on the machine do not count against it; wall time on a GPU); ``fp32_matmul`` as the run option."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device, DTYPES[precision])
    b = torch.randn(k, n, generator=g).to(device, DTYPES[precision])
    inner = max(1, int(2e8 // (2 * m * k * n)))  # at least ~0.2 GFLOP per timing
    with use_precision("fp32", "auto", fp32_matmul):

        def run() -> None:
            for _ in range(inner):
                a @ b

        run()  # warm-up
        rates = []
        for _ in range(repeats):
            w, c = _timed(run, device)
            rates.append(2 * m * k * n * inner / (w if device.type == "cuda" else c) / 1e9)
    return statistics.median(rates)


def peak_gflops(precision: str, device: torch.device, n: int, repeats: int = 7) -> float:
    """The practical peak: median GFLOP/s of an ``n``×``n``×``n`` matrix product at ``precision``."""
    return gemm_gflops(n, n, n, precision, device, repeats)


def print_gemm_table(device: torch.device, n: int) -> None:
    """GFLOP/s of the large GEMM and of the MLP's batch-50 layer shapes: fp32 (default BLAS), fp32 with
    ``fp32_matmul=bf16`` (oneDNN, bf16 internal arithmetic) and bf16."""
    print("| GEMM (m×k·k×n) | fp32 | fp32, fp32_matmul=bf16 | bf16 |")
    print("|---|---|---|---|")
    for m, k, nn_ in ((n, n, n), (50, 784, 200), (50, 200, 200), (200, 50, 784), (500, 784, 200)):
        row = [gemm_gflops(m, k, nn_, "fp32", device), gemm_gflops(m, k, nn_, "fp32", device, fp32_matmul="bf16"),
               gemm_gflops(m, k, nn_, "bf16", device)]
        print(f"| {m}×{k}·{k}×{nn_} | " + " | ".join(f"{r:.0f}" for r in row) + " |", flush=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(device), torch.randn(n, n, generator=g).to(device)
    exact = a.double() @ b.double()
    errors = []
    for q, mode in (("fp32", "ieee"), ("fp32", "bf16"), ("bf16", "ieee")):
        with use_precision("fp32", "auto", mode):
            out = (a.to(DTYPES[q]) @ b.to(DTYPES[q])).double()
        errors.append(((out - exact).abs().max() / exact.abs().max()).item())
    print(f"| largest error / largest entry ({n}³) | " + " | ".join(f"{e:.1e}" for e in errors) + " |")


def engine_round_times(fed: Federation, model: str, opts: dict, rounds: int, executor: str, *,
                       algorithm: str = "fedavg", workers: int = 2, threads: int = 1, precision: str = "fp32",
                       memory_format: str = "auto", device: torch.device) -> tuple[list, list]:
    """(wall, CPU) seconds of every timed round of the engine with ``executor``."""
    cfg = apply(RunConfig(), dict(
        algorithm=algorithm, dataset="mnist", model=model, model_options=opts, clients=len(fed.clients),
        clients_per_round=PER_ROUND, rounds=rounds + 2, local_epochs=1, batch_size=BATCH, lr=LR,
        eval_every=10_000, plots=False, partition="iid", device=str(device), executor=executor,
        precision=precision, memory_format=memory_format, threads=threads,
    ))
    ex = (ProcessExecutor(fed.clients, cfg.seed, workers=workers, threads=threads) if executor == "processes"
          else make_executor(executor, fed.clients, cfg.seed, threads=threads))
    cpu: list[float] = []
    last = [time.process_time()]

    def tick(rec: dict) -> None:
        _sync(device)
        now = time.process_time()
        cpu.append(now - last[0])
        last[0] = now

    exp = experiment(cfg, fed=fed, executor=ex, on_round=tick)
    last[0] = time.process_time()
    exp.run()
    if isinstance(ex, StackedExecutor):
        routes = ROUTES.setdefault(algorithm, {})
        for route, n in ex.routes.items():
            routes[route] = routes.get(route, 0) + n
    return [h["seconds"] for h in exp.history[1:-1]], cpu[1:-1]


def plain_round_times(fed: Federation, model_name: str, opts: dict, rounds: int, *, precision: str = "fp32",
                      device: torch.device) -> tuple[list, list]:
    """A hand-written FedAvg round: every client trained in turn with ``torch.optim.SGD``, then averaged.  At
    bf16 the forward pass and loss run under autocast (the engine's ``train_autocast`` and memory-format rule)."""
    torch.manual_seed(0)
    model = build_model(model_name, (1, 28, 28), 10, **opts).to(device)
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
                perm = torch.randperm(len(data), generator=gen).to(device)
                layout = train_layout(model, data.x) if precision != "fp32" else contextlib.nullcontext()
                with layout:
                    for s in range(0, len(data), BATCH):
                        idx = perm[s : s + BATCH]
                        with train_autocast(device):
                            loss = torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
                weights.append(len(data))
            total = float(sum(weights))
            state["g"] = {k: sum(s[k] * (w / total) for s, w in zip(states, weights)) for k in states[0]}

        with use_precision(precision, "auto"):
            w, c = _timed(one_round, device)
        walls.append(w)
        cpus.append(c)
    return walls[1:], cpus[1:]


@dataclasses.dataclass
class StepBench:
    """One step of 10 clients on the 784-200-200-10 MLP, both ways: ``plain()`` runs the plain loop's 10
    ``torch.optim.SGD`` steps, ``stacked_step()`` the stacked executor's one step (``_StackedStep`` gradients and
    ``_StackedOptimizer`` update) on the clients' stacked first batches."""

    model: torch.nn.Module
    progs: list
    x: torch.Tensor
    y: torch.Tensor
    stacked: Any
    step: Any
    plain: Callable[[], None]
    stacked_step: Callable[[], None]


def step_bench(fed: Federation, device: torch.device) -> StepBench:
    from fedfuse.engine.client import TrainConfig
    from fedfuse.engine.program import ClientProgram
    from fedfuse.executors.batched import _Stacked, _StackedOptimizer
    from fedfuse.executors.stacked import _StackedStep

    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10, widths=[200, 200]).to(device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spec = TrainConfig(batch_size=BATCH, lr=LR)
    progs = [ClientProgram(model=model, init=init, spec=spec, finalize=lambda s, st: (s, st))
             for _ in range(PER_ROUND)]
    x = torch.stack([fed.clients[c].train.x[:BATCH] for c in range(PER_ROUND)])
    y = torch.stack([fed.clients[c].train.y[:BATCH] for c in range(PER_ROUND)])
    stacked = _Stacked(progs)
    step = _StackedStep(progs[0], stacked.base, True)
    opt = _StackedOptimizer(spec, [stacked.P[n] for n in step.opt_names])
    sgd = torch.optim.SGD(model.parameters(), lr=LR)

    def plain() -> None:
        for c in range(PER_ROUND):
            with train_autocast(device):
                loss = torch.nn.functional.cross_entropy(model(x[c]), y[c])
            sgd.zero_grad()
            loss.backward()
            sgd.step()

    def stacked_step() -> None:
        grads, _ = step.grads(stacked, x, y, None, 0)
        opt.step(grads, None)

    return StepBench(model, progs, x, y, stacked, step, plain, stacked_step)


def step_times(fed: Federation, repeats: int, device: torch.device) -> None:
    """One optimiser step of 10 clients on the 784-200-200-10 MLP, without the round around it (interleaved,
    median CPU ms): the plain loop's 10 ``torch.optim.SGD`` steps, and the stacked executor's step (its
    ``_StackedStep`` gradients and ``_StackedOptimizer`` update on the clients' stacked batches) per precision."""
    b = step_bench(fed, device)
    plain, stacked_step = b.plain, b.stacked_step

    variants = {"plain, fp32": (plain, "fp32"), "plain, bf16": (plain, "bf16"),
                "stacked step, fp32": (stacked_step, "fp32"), "stacked step, bf16": (stacked_step, "bf16")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(max(repeats, 1) * 10):
        for key, (fn, q) in variants.items():
            with use_precision(q, "auto"):
                times[key].append(_timed(fn, device)[0 if device.type == "cuda" else 1])
    base = statistics.median(times["plain, fp32"])
    print(f"\none optimiser step of {PER_ROUND} clients (MLP 784-200-200-10, batch {BATCH}), no round around it")
    print("| variant | ms per step of all clients | × plain fp32 |")
    print("|---|---|---|")
    for key, ts in times.items():
        print(f"| {key} | {1e3 * statistics.median(ts):.2f} | {base / statistics.median(ts):.2f}× |")


#: Operator families of a step's profile (torch.profiler self CPU time), by ATen name.
OP_FAMILIES = (("matrix products", ("mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul", "linear")),
               ("dtype casts and copies", ("copy_", "_to_copy", "to", "clone")),
               ("optimiser update", ("_foreach_add_", "add_", "sub_", "mul_")),
               ("loss (log-softmax, NLL)", ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward",
                                            "nll_loss_backward", "nll_loss", "nll_loss_nd", "cross_entropy_loss")))


def _family(op: str) -> str:
    name = op.removeprefix("aten::")
    for family, names in OP_FAMILIES:
        if name in names:
            return family
    return "everything else (views, ReLU, sums, autograd bookkeeping)"


def breakdown(fed: Federation, repeats: int, rounds: int, device: torch.device) -> None:
    """Where the MLP's time goes: (1) one step of 10 clients, plain loop and stacked step at each precision, by
    operator family (``torch.profiler``, self CPU time per step); (2) a stacked round at each precision, split into
    the gradient computation, the optimiser update, the rest of the group's training (batch gathering, stacking
    and unstacking the clients' states, finalize) and the engine's round around it (sampling, reply checks,
    aggregation), by CPU-time accounting around those calls."""
    from torch.profiler import ProfilerActivity, profile

    from fedfuse.executors.batched import BatchedExecutor, _GroupStep, _Stacked, _StackedOptimizer

    b = step_bench(fed, device)
    model, progs, x, y, stacked, step = b.model, b.progs, b.x, b.y, b.stacked, b.step
    plain, stacked_step = b.plain, b.stacked_step

    n = 20 * max(repeats, 1)
    print(f"\n(1) one step of {PER_ROUND} clients (MLP 784-200-200-10, batch {BATCH}): self CPU ms per step by "
          f"operator family, torch.profiler over {n} steps")
    cols: dict[str, dict[str, float]] = {}
    for label, fn, q in (("plain, fp32", plain, "fp32"), ("plain, bf16", plain, "bf16"),
                         ("stacked, fp32", stacked_step, "fp32"), ("stacked, bf16", stacked_step, "bf16")):
        with use_precision(q, "auto"):
            for _ in range(5):
                fn()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(n):
                    fn()
        fam: dict[str, float] = {}
        for ev in prof.key_averages():
            fam[_family(ev.key)] = fam.get(_family(ev.key), 0.0) + ev.self_cpu_time_total / 1e3 / n
        cols[label] = fam
    families = [f for f, _ in OP_FAMILIES] + [_family("?")]
    print("| operator family | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for f in families:
        print(f"| {f} | " + " | ".join(f"{c.get(f, 0.0):.2f}" for c in cols.values()) + " |")
    print("| **total** | " + " | ".join(f"**{sum(c.values()):.2f}**" for c in cols.values()) + " |")

    # (1b) the casts: the same bf16 step with the weights' bf16 copies as autograd leaves (no cast of the
    # gradient back to fp32; the update reads the bf16 gradient into the fp32 weight), interleaved
    from fedfuse.executors.stacked import stacked_cross_entropy

    names = step.opt_names
    other = _Stacked(progs)
    leaves_p = [other.P[k] for k in names]

    def leaves_step() -> None:
        q = {k: p.detach().to(torch.bfloat16).requires_grad_() for k, p in zip(names, leaves_p, strict=True)}
        with train_autocast(device):
            _, logits = step.stacked_forward(model, q.__getitem__, x)
            loss = stacked_cross_entropy(logits, y, None)
        g = torch.autograd.grad(loss.sum(), [q[k] for k in names])
        with torch.no_grad():
            torch._foreach_add_(leaves_p, list(g), alpha=-LR)

    fresh = _Stacked(progs)
    for k in names:
        stacked.P[k].data.copy_(fresh.P[k])
    casts: dict[str, list[float]] = {"autocast (fp32 leaves)": [], "bf16 leaves": []}
    with use_precision("bf16", "auto"):
        for _ in range(n):
            for label, fn in (("autocast (fp32 leaves)", stacked_step), ("bf16 leaves", leaves_step)):
                casts[label].append(_timed(fn, device)[0 if device.type == "cuda" else 1])
    diff = max(float((stacked.P[k] - other.P[k]).detach().abs().max()) for k in names)
    print(f"\n(1b) the stacked bf16 step, median CPU ms over {n} interleaved steps: " + ", ".join(
        f"{k} {1e3 * statistics.median(v):.2f}" for k, v in casts.items()) + f"; largest weight difference "
        f"after {n} steps {diff:.1e}")

    spent: dict[str, float] = {}

    def timed(cls: type, name: str, key: str) -> Callable[[], None]:
        orig = getattr(cls, name)

        def wrapper(*a: object, **k: object) -> object:
            t = time.process_time()
            try:
                return orig(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.process_time() - t

        setattr(cls, name, wrapper)
        return lambda: setattr(cls, name, orig)

    print(f"\n(2) a stacked round (FedAvg, {PER_ROUND} clients × {PER_CLIENT // BATCH} steps): CPU ms per round, "
          f"{rounds} rounds × {max(repeats, 1)} repeats, accounted around the calls")
    rows: dict[str, dict[str, float]] = {}
    for q in ("fp32", "bf16"):
        undo = [timed(_GroupStep, "grads", "gradients (forward + backward)"),
                timed(_StackedOptimizer, "step", "optimiser update"),
                timed(BatchedExecutor, "train_group", "group")]
        try:
            spent.clear()
            total = 0.0
            for _ in range(max(repeats, 1)):
                _, c = engine_round_times(fed, "mlp", {"widths": [200, 200]}, rounds, "stacked", precision=q,
                                          device=device)
                total += sum(c)
            # the wrappers also counted the untimed first and last rounds: scale by the timed share
            runs = max(repeats, 1) * (rounds + 2)
            per = {k: 1e3 * v / runs for k, v in spent.items()}
        finally:
            for u in undo:
                u()
        round_ms = 1e3 * total / (max(repeats, 1) * rounds)
        g, o = per.get("gradients (forward + backward)", 0.0), per.get("optimiser update", 0.0)
        rows[q] = {"gradients (forward + backward)": g, "optimiser update": o,
                   "rest of the group's training (batches, stacking, finalize)": per.get("group", 0.0) - g - o,
                   "the engine's round around it (sampling, checks, aggregation)": round_ms - per.get("group", 0.0),
                   "**round**": round_ms}
    print("| part | stacked, fp32 | stacked, bf16 |")
    print("|---|---|---|")
    for part in rows["fp32"]:
        print(f"| {part} | " + " | ".join(f"{rows[q][part]:.1f} ({rows[q][part] / rows[q]['**round**']:.0%})"
                                          for q in rows) + " |")


MODELS = {  # variant → (label, registry model, options)
    "mlp": ("MLP 784-200-200-10", "mlp", {"widths": [200, 200]}),
    "cnn": ("McMahan CNN", "cnn", {}),
    "mlp-small": ("MLP 784-32-10", "mlp", {"widths": [32]}),
}


def round_gflop(fed: Federation, model_name: str, opts: dict) -> float:
    """Training GFLOPs of one round (forward + backward of every sample, ``torch.utils.flop_counter``)."""
    model = build_model(model_name, (1, 28, 28), 10, **opts)
    x, y = fed.clients[0].train.x[:8].cpu(), fed.clients[0].train.y[:8].cpu()
    return train_flops_per_sample(model, x, y) * PER_ROUND * PER_CLIENT / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process and of each worker")
    p.add_argument("--models", default="mlp,cnn", help="which of mlp,cnn,mlp-small to time")
    p.add_argument("--executors", default="sequential,batched,stacked,processes,auto")
    p.add_argument("--precisions", default="fp32,bf16", help="engine precisions to time (fp32, bf16)")
    p.add_argument("--memory-formats", default="auto", help="CNN layouts to time: auto, contiguous, channels_last")
    p.add_argument("--workers", type=int, default=2, help="worker processes of the processes executor")
    p.add_argument("--algorithms", default="", help="also time these algorithms, sequential fp32 vs --fast, on the MLP")
    p.add_argument("--all-participants", action="store_true",
                   help="give algorithms that train every participant every round (msfusion, dpsgd) all 100 clients "
                        "(default: 10, as many clients per round as the others train)")
    p.add_argument("--fast", default="stacked/bf16,batched/bf16",
                   help="EXECUTOR/PRECISION list the --algorithms table compares with sequential fp32")
    p.add_argument("--peak-size", type=int, default=2048, help="size n of the n×n×n peak GEMM")
    p.add_argument("--gpu", action="store_true", help="run everything on cuda")
    p.add_argument("--gemm", action="store_true", help="only print the GEMM table (peak and the MLP's shapes)")
    p.add_argument("--step", action="store_true", help="only time one step of 10 clients: plain vs stacked")
    p.add_argument("--breakdown", action="store_true",
                   help="only print where the MLP's time goes: a step by operator family, a stacked round by part")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device")
    if args.gemm:
        print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}, device {device}, "
              f"threads {torch.get_num_threads()}; GFLOP/s, medians")
        print_gemm_table(device, args.peak_size)
        return
    fed = make_federation(args.data_dir, device)
    if args.step:
        print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}, device {device}, "
              f"threads {torch.get_num_threads()}; medians of {max(args.repeats, 1) * 10} interleaved repeats")
        step_times(fed, args.repeats, device)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        return
    if args.breakdown:
        print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}, device {device}, "
              f"threads {torch.get_num_threads()}")
        breakdown(fed, args.repeats, args.rounds, device)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        return
    executors = [e for e in args.executors.split(",") if e and not (args.gpu and e == "processes")]
    precisions = [q for q in args.precisions.split(",") if q]
    formats = [f for f in args.memory_formats.split(",") if f]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start; "
          f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, data "
          f"{'real MNIST' if args.data_dir else 'random MNIST-shaped'}, {args.rounds} rounds × {args.repeats} "
          f"repeats, processes: {args.workers} workers")
    peak = {q: peak_gflops(q, device, args.peak_size) for q in ("fp32", "bf16")}
    print(f"practical peak (GEMM {args.peak_size}³): " + ", ".join(f"{q} {v:.0f} GFLOP/s" for q, v in peak.items()))
    for variant in [m for m in args.models.split(",") if m]:
        name, m, opts = MODELS[variant]
        gflop = round_gflop(fed, m, opts)
        conv = variant == "cnn"
        specs: dict[str, tuple] = {"plain": ("plain", "fp32", "auto")}
        if "bf16" in precisions:
            specs["plain-bf16"] = ("plain", "bf16", "auto")
        for ex in executors:
            for q in precisions:
                for f in (formats if conv else ["auto"]):
                    specs[f"{ex}/{q}" + (f"/{f}" if conv and len(formats) > 1 else "")] = (ex, q, f)
        times: dict[str, tuple[list, list]] = {k: ([], []) for k in specs}
        for _ in range(args.repeats):  # interleaved so machine noise hits every variant alike
            for key, (ex, q, f) in specs.items():
                if ex == "plain":
                    w, c = plain_round_times(fed, m, opts, args.rounds, precision=q, device=device)
                else:
                    w, c = engine_round_times(fed, m, opts, args.rounds, ex, workers=args.workers,
                                              threads=args.threads, precision=q, memory_format=f, device=device)
                times[key][0].extend(w)
                times[key][1].extend(c)
        on_gpu = device.type == "cuda"
        pw, pc = statistics.median(times["plain"][0]), statistics.median(times["plain"][1])
        base = pw if on_gpu else pc
        print(f"\n{name}: {gflop:.1f} training GFLOP per round")
        print("| variant | s/round (wall) | CPU s/round | × plain | GFLOP/s | of peak |")
        print("|---|---|---|---|---|---|")
        for key, (w, c) in times.items():
            mw, mc = statistics.median(w), statistics.median(c)
            q = specs[key][1]
            if specs[key][0] == "processes":  # work in the workers: wall time, GFLOP/s per worker
                t, per, cpu_col = mw, mw * args.workers, "n/a (workers)"
                speed = f"{pw / mw:.2f}× (wall)"
            else:
                t = mw if on_gpu else mc
                per, cpu_col, speed = t, f"{mc:.3f}", f"{base / t:.2f}×"
            rate = gflop / per
            print(f"| {key} | {mw:.3f} | {cpu_col} | {speed} | {rate:.0f} | {rate / peak[q]:.0%} |")
        print(f"| peak ({'bf16' if 'bf16' in precisions else 'fp32'}) | | | "
              f"{(peak['bf16' if 'bf16' in precisions else 'fp32']) / (gflop / base):.2f}× | "
              f"{peak['bf16' if 'bf16' in precisions else 'fp32']:.0f} | 100% |")
    algos = [a for a in args.algorithms.split(",") if a]
    if algos:
        name, _, opts = MODELS["mlp"]
        fast = [tuple(f.split("/")) for f in args.fast.split(",") if f]
        print(f"\nalgorithms on the {name}: sequential fp32 vs {', '.join(args.fast.split(','))} (CPU-time speed-ups)")
        print("| algorithm | sequential fp32 CPU s/round | " + " | ".join(
            f"{ex}/{q} CPU s/round | speed-up (CPU) | speed-up (wall)" for ex, q in fast) + " |")
        print("|---|---|" + "---|---|---|" * len(fast))
        for algo in algos:
            afed = fed
            if algo in EVERY_CLIENT_EVERY_ROUND and not args.all_participants:
                afed = dataclasses.replace(fed, clients=fed.clients[:PER_ROUND])
            res: dict[tuple, tuple[list, list]] = {("sequential", "fp32"): ([], []), **{f: ([], []) for f in fast}}
            for _ in range(args.repeats):
                for ex, q in res:
                    w, c = engine_round_times(afed, "mlp", opts, args.rounds, ex, algorithm=algo,
                                              threads=args.threads, precision=q, device=device)
                    res[(ex, q)][0].extend(w)
                    res[(ex, q)][1].extend(c)
            sw, sc = (statistics.median(v) for v in res[("sequential", "fp32")])
            cells = []
            for f in fast:
                fw, fc = (statistics.median(v) for v in res[f])
                cells.append(f"{fc:.3f} | {sc / fc:.2f}× | {sw / fw:.2f}×")
            label = f"{algo} ({len(afed.clients)} participants)" if algo in EVERY_CLIENT_EVERY_ROUND else algo
            print(f"| {label} | {sc:.3f} | " + " | ".join(cells) + " |", flush=True)
    if ROUTES:
        print("\nstacked executor routes (groups): " + "; ".join(
            f"{a}: " + ", ".join(f"{r} ×{n}" for r, n in routes.items()) for a, routes in ROUTES.items()))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")

if __name__ == "__main__":
    main()
