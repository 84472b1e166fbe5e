"""Executors: the ``for_each_client`` seam between the round loop and the clients' work.

The loop hands an executor a list of jobs (client id, payload, client state) and a pure client
function; the executor decides where and how they run.  Every job seeds its own random streams from
(seed, purpose, round, stage, client), so the result is the same whatever the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedfuse.algorithms.base import ClientState
from fedfuse.rng import derive_seed, torch_generator
from fedfuse.types import ClientData, Message


@dataclass(frozen=True)
class Job:
    cid: int
    payload: Message
    state: ClientState
    keys: tuple[int | str, ...]  # (purpose, round, stage): combined with the seed and the client id


ClientFn = Callable[[Message, ClientState, ClientData, torch.Generator], Any]


class SequentialExecutor:
    """Runs clients one after another in this process (the reference engine)."""

    name = "sequential"

    def __init__(self, clients: Sequence[ClientData], seed: int) -> None:
        self.clients = clients
        self.seed = seed

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for job in jobs:
            out[job.cid] = self.run_one(fn, job)
        return out

    def run_one(self, fn: ClientFn, job: Job) -> Any:
        # Dropout and other global-RNG users are seeded per job; data order uses the explicit generator.
        torch.manual_seed(derive_seed(self.seed, *job.keys, job.cid, "torch"))
        gen = torch_generator(self.seed, *job.keys, job.cid)
        return fn(job.payload, job.state, self.clients[job.cid], gen)


EXECUTORS: dict[str, type[SequentialExecutor]] = {"sequential": SequentialExecutor}
