"""The two seams of the engine, as typed protocols: what the round loop needs from an algorithm
(:class:`Algorithm`) and from an executor (:class:`Executor`), and the unit of client work between them
(:class:`Job`).

The engine types its edges with these protocols and never imports ``fedfuse.algorithms``.  Algorithm authors
do not implement this protocol by hand: they subclass :class:`fedfuse.algorithms.base.Algorithm`, which
declares every hook below with its default and documents it (read that file, not this one).  Every hook is
always present, so the engine calls it unconditionally: there is no optional capability found by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from fedfuse.engine.context import ClientState, RoundInfo, RunContext, ServerState
from fedfuse.engine.routing import RouteLog
from fedfuse.types import ClientData, Federation, Message, TensorDict

if TYPE_CHECKING:
    from fedfuse.engine.personal import StaysLocal
    from fedfuse.engine.program import ClientProgram


@dataclass(frozen=True)
class Job:
    """One client's work in a round: who, what it was sent, its persistent state, and the keys of its random
    streams ((purpose, round, stage), combined with the run seed and the client id)."""

    cid: int
    payload: Message
    state: Any  # the client's persistent state (the algorithm's ClientState)
    keys: tuple[int | str, ...]


#: ``fn(payload, client_state, data, generator)``: a client-side function an executor maps over jobs.
ClientFn = Callable[[Message, Any, ClientData, torch.Generator], Any]


class Algorithm(Protocol):
    """What the engine calls on an algorithm, in round order (see :mod:`fedfuse.algorithms.base`)."""

    ctx: RunContext

    @property
    def name(self) -> str: ...
    @property
    def echo_meta(self) -> tuple[str, ...]: ...
    @property
    def reply_kind(self) -> str | None: ...
    @property
    def default_sampling(self) -> str: ...
    @property
    def node_private(self) -> tuple[str, ...]: ...
    @property
    def server_data(self) -> str | None: ...
    @property
    def accepts_late(self) -> bool: ...
    @property
    def stays_local(self) -> StaysLocal | None: ...
    @property
    def selects_own_clients(self) -> bool: ...

    def setup(self, fed: Federation) -> Federation: ...
    def init_state(self) -> ServerState: ...
    def init_client_state(self, cid: int) -> ClientState: ...
    def select_clients(self, info: RoundInfo, rng: np.random.Generator) -> list[int]: ...
    def num_stages(self, state: ServerState, info: RoundInfo) -> int: ...
    def configure_fit(self, state: ServerState, info: RoundInfo, clients: list[int]) -> dict[int, Message]: ...
    def client_program(self, payload: Message, client_state: ClientState,
                       data: ClientData) -> ClientProgram | None: ...
    def fit(self, payload: Message, client_state: ClientState, data: ClientData,
            gen: torch.Generator) -> tuple[Message, ClientState]: ...
    def reply_shapes(self, cid: int, reply: Message) -> dict[str, tuple[int, ...]]: ...
    def exchange(self, info: RoundInfo, results: dict[int, Message]) -> tuple[dict[int, Message], int]: ...
    def aggregate_fit(self, state: ServerState, info: RoundInfo, results: dict[int, Message]) -> ServerState: ...
    def secure_contribution(self, sent: Message, reply: Message) -> TensorDict: ...
    def aggregate_sum(self, state: ServerState, info: RoundInfo, total: TensorDict) -> ServerState: ...
    def global_model(self, state: ServerState) -> tuple[TensorDict, dict[str, Any]] | None: ...
    def server_parameters(self, state: ServerState) -> int: ...
    def configure_evaluate(self, state: ServerState, clients: list[int]) -> dict[int, Message]: ...
    def evaluate(self, payload: Message, client_state: ClientState, data: ClientData,
                 gen: torch.Generator) -> dict[str, float]: ...
    def diagnostics(self, state: ServerState, fed: Federation, info: RoundInfo) -> dict[str, Any]: ...
    def finish(self, state: ServerState, fed: Federation, out_dir: Path | None) -> None: ...


class Executor(Protocol):
    """Runs the clients' work of a round (``engine/executor.py`` lists the executors).

    ``fit`` runs the algorithm's client step for every job (its declared ``client_program`` when it has one,
    else its ``fit``); ``map`` runs any client function (evaluation).  Both return ``{cid: result}``.
    """

    name: str

    def fit(self, target: Algorithm, jobs: Sequence[Job]) -> dict[int, Any]: ...
    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]: ...
    def bind(self, ctx: RunContext) -> None:
        """Learn the run's context (executors that send the local-training settings along); usually a no-op."""
    def restore(self, choice: str | None) -> None:
        """Resume with the choice recorded in the checkpoint (``describe()`` of the interrupted run)."""
    def present(self) -> set[int] | None:
        """The clients that can take part now (a Flower node holding their data is connected); ``None``: all."""
    def close(self) -> None:
        """Release workers."""
    def describe(self) -> str: ...
    def routing(self) -> RouteLog:
        """The path that trained each client and why any left the executor's own (``engine/routing.py``); the
        loop checkpoints it and writes it to the summary."""


__all__ = ["Algorithm", "ClientFn", "Executor", "Job"]
