"""``--executor flower``: fedfuse's clients run under Flower's simulation runtime (Ray).

:class:`SimulationExecutor` is a :class:`~fedfuse.flower.executor.FlowerExecutor` whose grid is the one of a
``ServerApp`` (:func:`fedfuse.flower.app.serving_app`) running in a background thread: every batch of jobs is
handed to that app through a queue and sent to the ``ClientApp`` (:data:`fedfuse.flower.app.client_app`) on the
simulated SuperNodes.  The composition root (:mod:`fedfuse.runner`) registers it as the executor ``flower``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from fedfuse.engine.executor import ClientFn, Job
from fedfuse.engine.processes import available_cores
from fedfuse.flower.app import client_app, quiet_flower, serving_app
from fedfuse.flower.executor import FlowerExecutor


class SimulationExecutor(FlowerExecutor):
    """``--executor flower``: Flower's simulation runtime, started on first use in a background thread.

    The ServerApp of the simulation serves this executor: each ``map`` call is handed to it through a queue
    and sent with its grid; ``close`` ends the ServerApp and the simulation.  ``num_nodes`` virtual
    SuperNodes (default: one per client), ``workers`` Ray actors with ``threads`` torch threads each.
    """

    def __init__(self, config: Any, seed: int, *, num_nodes: int, workers: int = 0, threads: int = 1,
                 round_timeout: float | None = None) -> None:
        super().__init__(None, config, seed, round_timeout=round_timeout, min_nodes=num_nodes)
        self.num_nodes = num_nodes
        self.workers = workers
        self.threads = threads
        self._requests: queue.Queue[Any] = queue.Queue()
        self._replies: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _start(self) -> None:
        quiet_flower()
        server = serving_app(self._requests, self._replies)
        cores = self.workers or available_cores()
        backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                   "init_args": {"num_cpus": cores, "logging_level": logging.ERROR, "log_to_driver": False,
                                 "include_dashboard": False}}

        def target() -> None:
            from flwr.simulation import run_simulation

            try:
                run_simulation(server, client_app, num_supernodes=self.num_nodes, backend_config=backend)
            except BaseException as e:  # surfaced on the next map call
                self._error = e
                self._replies.put(e)

        self._thread = threading.Thread(target=target, name="flower-simulation", daemon=True)
        self._thread.start()

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        if self._thread is None:
            self._start()
        if self._error is not None:
            raise RuntimeError(f"the Flower simulation stopped: {self._error}") from self._error
        self._requests.put((self, fn, list(jobs)))
        reply = self._replies.get()
        if isinstance(reply, BaseException):
            raise RuntimeError(f"the Flower simulation failed: {reply}") from reply
        return reply

    def present(self) -> set[int] | None:
        """Every client: the simulation's virtual nodes rebuild the federation from the config."""
        return None

    def serve(self, grid: Any, fn: ClientFn, jobs: list[Job]) -> dict[int, Any]:
        """Called in the ServerApp's thread with its grid."""
        self.grid = grid
        return FlowerExecutor.map(self, fn, jobs)

    def close(self) -> None:
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=120)
            self._thread = None

    def describe(self) -> str:
        return f"flower(simulation, {self.num_nodes} nodes)"
