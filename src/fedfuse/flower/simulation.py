"""``--executor flower``: fedfuse's clients run under Flower's simulation runtime, started the way Flower 1.41
recommends — ``flwr run`` of a Flower app on a local SuperLink in simulation mode — instead of the deprecated
``flwr.simulation.run_simulation``.

:class:`SimulationExecutor` starts, on first use, a loopback SuperLink (``flower-superlink --insecure
--simulation``, :class:`~fedfuse.flower.federation.LocalFederation` with ``simulation=True``) and submits a Flower app
whose ServerApp is :data:`fedfuse.flower.app.relay_app` and whose ClientApp is fedfuse's
:data:`~fedfuse.flower.app.client_app`, with ``--federation-config`` setting the simulated SuperNodes and the Ray
resources.  Flower's ``flwr-simulation`` process then runs the ServerApp and the ClientApps (Ray actors).  The
ServerApp connects back to this process over a loopback connection with a random authentication key (objects
pickled with the standard pickler: torch's shared-memory reductions do not cross unrelated processes); fedfuse's
round loop stays here, and every batch of jobs travels to the ServerApp, which sends one Flower message per job
to the simulated nodes (the same wire and ClientApp as a deployment) and returns the results.  The composition
root (:mod:`fedfuse.runner`) registers it as the executor ``flower``.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from fedfuse.engine.executor import ClientFn, Job
from fedfuse.executors.processes import available_cores
from fedfuse.flower.executor import METHODS, FlowerExecutor

log = logging.getLogger("fedfuse")

START_TIMEOUT = 600.0  # seconds for the SuperLink, flwr-simulation, Ray and the ServerApp to come up


class SimulationExecutor(FlowerExecutor):
    """``--executor flower``: Flower's simulation runtime via ``flwr run``, started on first use.

    ``num_nodes`` simulated SuperNodes (default: one per client), ``workers`` Ray actors (CPUs; default the
    cores available) with ``threads`` torch threads each.  ``close`` ends the run and stops the SuperLink.
    """

    def __init__(self, config: Any, seed: int, *, num_nodes: int, workers: int = 0, threads: int = 1,
                 round_timeout: float | None = None) -> None:
        super().__init__(None, config, seed, round_timeout=round_timeout, min_nodes=num_nodes)
        self.num_nodes = num_nodes
        self.data_dir = config.data_dir or os.environ.get("FEDFUSE_DATA")
        self.base = (config.algorithm_options or {}).get("base") or None
        self.hf_path = str(config.dataset)[3:] if str(config.dataset).startswith("hf:") else None
        self.workers = workers
        self.threads = threads
        self._fed: Any = None
        self._run_id: int | None = None
        self._conn: Connection | None = None
        self._dir: Path | None = None

    def _start(self) -> None:
        from fedfuse.flower.deploy import CLIENTAPP, write_app
        from fedfuse.flower.federation import LocalFederation

        self._dir = Path(tempfile.mkdtemp(prefix="fedfuse-flower-"))
        key = os.urandom(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        app = write_app(self._dir / "app", None, serverapp="fedfuse.flower.app:relay_app", clientapp=CLIENTAPP,
                        insecure=True, run_config={"fedfuse-run": self.run_json, "relay": f"{host}:{port}",
                                                   "relay-key": key.hex(), "min-nodes": self.num_nodes})
        src = str(Path(__file__).resolve().parents[2])  # this checkout's src/, also in Flower's processes
        env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
               "RAY_DEDUP_LOGS": "0", "FEDFUSE_THREADS": str(self.threads)}
        # the simulated nodes run on this machine for this user: their own paths (node_policy) are this run's
        own = {"FEDFUSE_DATA": self.data_dir, "FEDFUSE_LORA_BASE": self.base, "FEDFUSE_HF_DATASET": self.hf_path}
        env.update({var: value for var, value in own.items() if value})
        self._fed = LocalFederation(self._dir / "fed", nodes=0, auth=False, env=env, simulation=True)
        atexit.register(self.close)  # a run that raised is not closed by its loop: stop the SuperLink anyway
        self._fed.start()
        cores = self.workers or available_cores()
        self._run_id = self._fed.run(app, federation_config={
            "num-supernodes": self.num_nodes, "client-resources-num-cpus": 1, "client-resources-num-gpus": 0.0,
            "init-args-num-cpus": cores, "init-args-num-gpus": 0, "init-args-logging-level": "error",
            "init-args-log-to-driver": False}, timeout=START_TIMEOUT)
        accepted: list[Connection] = []
        waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        waiter.start()
        deadline = time.monotonic() + START_TIMEOUT
        while waiter.is_alive():
            waiter.join(0.2)
            if waiter.is_alive() and (not self._fed.streaming(self._run_id) or time.monotonic() > deadline):
                log_tail = (self._fed.logs / f"run-{self._run_id}.log").read_text(errors="replace")[-3000:]
                listener.close()
                self.close()
                raise RuntimeError(f"the Flower simulation did not start its ServerApp:\n{log_tail}")
        listener.close()
        self._conn = accepted[0]

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        method = getattr(fn, "__name__", "")
        if getattr(fn, "__self__", None) is None or method not in METHODS:
            raise ValueError(f"the Flower executor runs the algorithm's {'/'.join(METHODS)} hooks, not {fn!r}")
        if self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send_bytes(pickle.dumps((method, list(jobs), self.train_json())))
            reply = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the Flower simulation stopped: {e}") from e
        if isinstance(reply, BaseException):
            raise RuntimeError(f"the Flower simulation failed: {reply}") from reply
        out, self.lost = reply
        for cid, reason in sorted(self.lost.items()):
            log.warning("flower: client %d did not reply: %s", cid, reason)
        return out

    def present(self) -> set[int] | None:
        """Every client: the simulated nodes rebuild the federation from the config."""
        return None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send_bytes(pickle.dumps(None))
                self._conn.close()
            except OSError:
                pass
            self._conn = None
        if self._fed is not None:
            if self._run_id is not None:
                try:
                    self._fed.wait(self._run_id, timeout=120)
                except Exception as e:  # the results are already here: report, then stop the SuperLink
                    log.warning("flower: the simulation run did not end cleanly: %s", e)
            self._fed.stop()
            self._fed = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        atexit.unregister(self.close)

    def describe(self) -> str:
        return f"flower(simulation, {self.num_nodes} nodes)"
