"""Executors: the ``for_each_client`` seam between the round loop and the clients' work.

The loop hands an executor a list of jobs (client id, payload, client state) and either a pure client
function (``map``: evaluation, custom client steps) or the algorithm itself (``fit``: the client step, which
an executor may run as the algorithm's declared :class:`~fedfuse.engine.program.ClientProgram`).  Every job
seeds its own random streams from (seed, purpose, round, stage, client), so the result is the same whatever
the order, the process or the batching.

This module holds the reference :class:`SequentialExecutor`; the others live in their own modules and are
found by name through :mod:`fedfuse.engine.executors`.

The engine imports no algorithm: executors are typed with the protocols of :mod:`fedfuse.engine.contract`
(``fit`` calls the algorithm's ``client_program`` and, when it declares none, its ``fit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedfuse.engine.context import RunContext
from fedfuse.engine.contract import Algorithm, ClientFn, Job
from fedfuse.engine.routing import RouteLog
from fedfuse.rng import derive_seed, torch_generator
from fedfuse.types import ClientData

__all__ = ["ClientFn", "Job", "SequentialExecutor", "job_generator", "seed_global"]


def job_generator(seed: int, job: Job) -> torch.Generator:
    """The job's data-order generator (the same in every executor)."""
    return torch_generator(seed, *job.keys, job.cid)


def seed_global(seed: int, job: Job) -> None:
    """Seed the global torch RNG for the job (dropout and other global-RNG users)."""
    torch.manual_seed(derive_seed(seed, *job.keys, job.cid, "torch"))


class SequentialExecutor:
    """Runs clients one after another in this process (the reference engine)."""

    name = "sequential"

    def __init__(self, clients: Sequence[ClientData], seed: int) -> None:
        self.clients = clients
        self.seed = seed
        self.route_log = RouteLog()  # every client training on this executor's own path (``name``)

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for job in jobs:
            out[job.cid] = self.run_one(fn, job)
        return out

    def fit(self, target: Algorithm, jobs: Sequence[Job]) -> dict[int, Any]:
        """The client step of ``target`` (an algorithm) for every job."""
        out = self.map(target.fit, jobs)
        self.route_log.ran(self.name, len(out))
        return out

    def run_one(self, fn: ClientFn, job: Job) -> Any:
        # Dropout and other global-RNG users are seeded per job; data order uses the explicit generator.
        seed_global(self.seed, job)
        return fn(job.payload, job.state, self.clients[job.cid], job_generator(self.seed, job))

    def bind(self, ctx: RunContext) -> None:
        """Nothing to learn: in-process clients read the algorithm's own context."""

    def restore(self, choice: str | None) -> None:
        """Nothing to restore: this executor makes no choice."""

    def present(self) -> set[int] | None:
        """Every client: their data is in this process."""
        return None

    def close(self) -> None:
        """Release workers (no-op here)."""

    def describe(self) -> str:
        return self.name

    def routing(self) -> RouteLog:
        return self.route_log
