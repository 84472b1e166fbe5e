"""The process executor: a pool of worker processes, each with its own torch threads.

For compute-bound models (a CNN whose client step is milliseconds of convolutions) batching in one process
does not help, but independent clients on separate cores do.  Workers are started once per algorithm
object (``fork`` on CPU, so the federation's tensors are shared copy-on-write and nothing is pickled;
``spawn`` when the model lives on a GPU, because CUDA cannot be forked).  Each job travels as a
``torch.save`` byte string (payload, client state, seed keys) and its reply comes back the same way, so no
shared-memory handles outlive a round.

Determinism: a worker seeds exactly as the sequential executor does (global torch RNG and data-order
generator from ``(seed, purpose, round, stage, client)``), and the loop fuses replies in client-id order, so
results equal the sequential executor's (bit-identical when both use the same number of torch threads).

Contract: an algorithm's client hooks (``fit``, ``evaluate``, ``client_program``) are pure functions of
their arguments, the run context and the options; the workers hold a copy of the algorithm object made when
the pool starts, so server hooks must keep server state in the ``state`` they return, not on ``self``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import multiprocessing as mp
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from fedfuse.engine.contract import ClientFn, Job
from fedfuse.engine.executor import SequentialExecutor, job_generator, seed_global
from fedfuse.runtime.precision import current_settings, use_precision
from fedfuse.types import ClientData, Message


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    # weights_only=False is safe here, and only here: these bytes never cross a trust boundary.  They are made by
    # _dumps in this process or in one of the pool's worker processes it forked/spawned itself, travel only
    # through that pool's own pipes (which carry the task tuple with the standard pickler anyway), and are never
    # written to a file or a socket anyone else can reach.  Jobs hold fedfuse objects (Job, Message), which
    # weights_only=True refuses.  Files on disk go through fedfuse.engine.checkpoint.safe_load instead.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


_WORKER: dict[str, Any] = {}


def _init_worker(target: Any, clients: Sequence[ClientData], seed: int, threads: int) -> None:
    torch.set_num_threads(max(1, threads))
    # A private copy: under ``spawn`` the target arrives through torch's shared-memory pickling, so without it every
    # worker would train the same tensors of the algorithm's cached modules at once.
    _WORKER.update(target=copy.deepcopy(target), clients=clients, seed=seed)


def _work(task: tuple[str, bytes, tuple[str, str, str]]) -> bytes:
    method, blob, settings = task
    job: Job = _loads(blob)
    fn = getattr(_WORKER["target"], method)
    seed = _WORKER["seed"]
    seed_global(seed, job)
    data = _WORKER["clients"][job.cid]
    device = data.train.x.device
    if device.type != "cpu":
        job = Job(job.cid, job.payload.to(device), _to_device(job.state, device), job.keys)
    with use_precision(*settings):  # the parent run's training precision and memory format
        return _dumps(fn(job.payload, job.state, data, job_generator(seed, job)))


class ProcessExecutor(SequentialExecutor):
    """Runs client jobs on ``workers`` processes (default: the cores available, at most 8).

    ``fit``/``map`` with a bound method of an algorithm run in the workers; any other function runs here.
    """

    name = "processes"

    def __init__(self, clients: Sequence[ClientData], seed: int, *, workers: int | None = None, threads: int = 1,
                 start_method: str | None = None) -> None:
        super().__init__(clients, seed)
        self.workers = max(1, workers or min(available_cores(), 8))
        self.threads = threads
        self.start_method = start_method
        self._pool: Any = None
        self._target: Any = None

    def _ensure(self, target: Any) -> Any:
        if self._pool is not None and self._target is target:
            return self._pool
        self.close()
        method = self.start_method
        if method is None:
            on_gpu = bool(self.clients) and self.clients[0].train.x.device.type != "cpu"
            method = "fork" if sys.platform.startswith("linux") and not on_gpu else "spawn"
        ctx = mp.get_context(method)
        self._pool = ctx.Pool(self.workers, initializer=_init_worker,
                              initargs=(target, self.clients, self.seed, self.threads))
        self._target = target
        return self._pool

    def map(self, fn: ClientFn, jobs: Sequence[Job]) -> dict[int, Any]:
        target = getattr(fn, "__self__", None)
        jobs = list(jobs)
        if target is None or len(jobs) <= 1:
            return super().map(fn, jobs)
        pool = self._ensure(target)
        cpu = torch.device("cpu")
        settings = current_settings()
        tasks = [(fn.__name__, _dumps(Job(job.cid, job.payload.to("cpu"), _to_device(job.state, cpu), job.keys)),
                  settings) for job in jobs]
        replies = pool.map(_work, tasks, chunksize=1)
        out: dict[int, Any] = {}
        device = self.clients[jobs[0].cid].train.x.device if self.clients else torch.device("cpu")
        for job, raw in zip(jobs, replies, strict=True):
            out[job.cid] = _to_device(_loads(raw), device)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
        self._pool = None
        self._target = None

    def describe(self) -> str:
        return f"processes({self.workers}×{self.threads} threads)"

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


def _to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors inside replies (Messages, dicts, tuples, lists) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Message):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj
