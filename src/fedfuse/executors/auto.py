"""``--executor auto``: a short probe on the first round's clients picks the executor.

The probe trains copies of the first jobs' declared programs for a few steps (nothing it computes is kept;
the round itself then runs normally) and times, per client-step,

- the sequential executor (two clients, ``probe_steps`` steps each, after one warm-up step);
- the batched executor (all probed clients together, same steps) when the program can be batched, and the
  stacked executor the same way when its stacked step applies (``executors/stacked.py``: linear models);

and estimates the process executor as the sequential time divided by the usable workers (cores available,
at most the clients per round) plus a 15 % transfer margin, considered only with ≥ 2 cores.  The fastest
wins.  Algorithms without a declared program choose between sequential and processes on the same estimate.
The choice is recorded in the summary and the checkpoint, so a resumed run keeps it (bit-identical resume).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from fedfuse.engine.context import RunContext
from fedfuse.engine.contract import Algorithm, ClientFn, Executor, Job
from fedfuse.engine.executor import SequentialExecutor, job_generator, seed_global
from fedfuse.engine.program import ClientProgram
from fedfuse.engine.routing import RouteLog
from fedfuse.executors.batched import BatchedExecutor, unbatchable_reason
from fedfuse.executors.processes import ProcessExecutor, available_cores
from fedfuse.executors.stacked import StackedExecutor, stacked_reason
from fedfuse.types import ClientData


class AutoExecutor:
    name = "auto"

    def __init__(self, clients: Sequence[ClientData], seed: int, *, threads: int = 1, probe_steps: int = 3,
                 probe_clients: int = 8) -> None:
        self.clients = clients
        self.seed = seed
        self.threads = threads
        self.probe_steps = probe_steps
        self.probe_clients = probe_clients
        self.inner: Executor | None = None
        self.timings: dict[str, float] = {}  # seconds per client-step measured or estimated by the probe
        self.route_log = RouteLog()  # the chosen executor writes its client trainings here

    def _clock(self) -> float:
        """Wall time after the device's queued work is done (CUDA kernels run asynchronously)."""
        if self.clients and self.clients[0].train.x.device.type == "cuda":
            torch.cuda.synchronize(self.clients[0].train.x.device)
        return time.perf_counter()

    # ---- choice --------------------------------------------------------------------------------
    def bind(self, ctx: RunContext) -> None:
        """Nothing to learn: every executor it may choose runs in this process or reads the algorithm."""

    def present(self) -> set[int] | None:
        """Every client: their data is in this process."""
        return None

    def restore(self, choice: str | None) -> None:
        """Reuse a recorded choice (resume)."""
        if choice:
            self._use(choice.split("(")[0].replace("auto→", ""))

    def _use(self, name: str) -> None:
        inner: SequentialExecutor
        if name == "batched":
            inner = BatchedExecutor(self.clients, self.seed)
        elif name == "stacked":
            inner = StackedExecutor(self.clients, self.seed)
        elif name == "processes":
            inner = ProcessExecutor(self.clients, self.seed, threads=self.threads)
        else:
            inner = SequentialExecutor(self.clients, self.seed)
        inner.route_log = self.route_log  # the chosen executor's client trainings are this executor's
        self.inner = inner

    def probe(self, target: Algorithm, jobs: Sequence[Job]) -> str:
        jobs = list(jobs)[: self.probe_clients]
        progs = [target.client_program(j.payload, j.state, self.clients[j.cid]) for j in jobs]
        workers = min(available_cores(), len(jobs))
        seq = BatchedExecutor(self.clients, self.seed)  # its _run_program is the sequential execution
        if any(p is None for p in progs) or not jobs:
            t0 = self._clock()
            if jobs:  # no declared program: time one whole client step (discarded)
                SequentialExecutor(self.clients, self.seed).run_one(target.fit, jobs[0])
            self.timings["sequential"] = self._clock() - t0
        else:
            steps = self.probe_steps
            short = [p.with_spec(max_steps=steps) for p in progs]
            seq._run_program(progs[0].with_spec(max_steps=1), jobs[0])  # warm-up (FLOP counting, caches)
            t0 = self._clock()
            n = min(2, len(jobs))
            for j, p in zip(jobs[:n], short[:n], strict=True):
                seq._run_program(p, j)
            self.timings["sequential"] = (self._clock() - t0) / (n * steps)
            if len(jobs) > 1 and unbatchable_reason(progs[0].model) is None:
                self._time_group("batched", BatchedExecutor(self.clients, self.seed), jobs, progs, steps)
                if stacked_reason(progs[0]) is None:
                    self._time_group("stacked", StackedExecutor(self.clients, self.seed), jobs, progs, steps)
        if workers >= 2:
            self.timings["processes"] = self.timings["sequential"] / workers * 1.15
        return min(self.timings, key=self.timings.__getitem__)

    def _time_group(self, name: str, executor: BatchedExecutor, jobs: list[Job], progs: list[ClientProgram],
                    steps: int) -> None:
        """Seconds per client-step of ``executor`` training the probed clients as one group for ``steps`` steps
        (after a one-step warm-up); nothing is recorded when the group cannot run that way."""
        try:
            executor.train_group(list(zip(jobs, [p.with_spec(max_steps=1) for p in progs], strict=True)))
            t0 = self._clock()
            executor.train_group(list(zip(jobs, [p.with_spec(max_steps=steps) for p in progs], strict=True)))
            self.timings[name] = (self._clock() - t0) / (len(jobs) * steps)
        except (RuntimeError, NotImplementedError):
            pass

    # ---- the seam ------------------------------------------------------------------------------
    def fit(self, target: Algorithm, jobs: Sequence[Job]) -> dict[int, Any]:
        if self.inner is None:
            self._use(self.probe(target, jobs))
            self.route_log.choice = choice_reason(self.timings)
        assert self.inner is not None
        return self.inner.fit(target, jobs)

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        if self.inner is None:
            self._use("sequential")
        assert self.inner is not None
        return self.inner.map(fn, jobs)

    def run_one(self, fn: ClientFn, job: Job) -> Any:
        seed_global(self.seed, job)
        return fn(job.payload, job.state, self.clients[job.cid], job_generator(self.seed, job))

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def describe(self) -> str:
        return f"auto→{self.inner.describe()}" if self.inner is not None else "auto"

    def routing(self) -> RouteLog:
        return self.route_log


def choice_reason(timings: dict[str, float]) -> str:
    """Why the probe chose its executor: the measured (processes: estimated) time per client-step of each."""
    ranked = sorted(timings.items(), key=lambda kv: kv[1])
    times = ", ".join(f"{name} {1e3 * t:.3g} ms" for name, t in ranked)
    return f"the probe's fastest per client-step of {times}"
