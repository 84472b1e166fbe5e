"""Executors above the engine's sequential reference, registered by name with the engine's registry
(:mod:`fedfuse.engine.executors`) when this package is imported:

- ``batched`` — clients of a declared program trained together with ``torch.func`` (:mod:`.batched`);
- ``stacked`` — ``batched`` with one batched matrix product per layer for linear models (:mod:`.stacked`);
- ``processes`` — a pool of worker processes (:mod:`.processes`);
- ``auto`` — a short probe picks one of the above or the sequential reference (:mod:`.auto`).

The composition root (:mod:`fedfuse.runner`) imports this package; code that builds an
:class:`~fedfuse.engine.loop.Experiment` itself and names one of these executors imports it too.
"""

from __future__ import annotations

from fedfuse.engine.executors import register_executor
from fedfuse.executors.auto import AutoExecutor
from fedfuse.executors.batched import BatchedExecutor
from fedfuse.executors.processes import ProcessExecutor
from fedfuse.executors.stacked import StackedExecutor

__all__ = ["AutoExecutor", "BatchedExecutor", "ProcessExecutor", "StackedExecutor", "register"]


def register() -> None:
    """Register ``batched``, ``stacked``, ``processes`` and ``auto`` with the engine (done on import; calling again
    is a no-op)."""
    register_executor("batched", lambda clients, seed, threads=0, config=None: BatchedExecutor(clients, seed))
    register_executor("stacked", lambda clients, seed, threads=0, config=None: StackedExecutor(clients, seed))
    register_executor("processes", lambda clients, seed, threads=0, config=None:
                      ProcessExecutor(clients, seed, threads=threads or 1))
    register_executor("auto", lambda clients, seed, threads=0, config=None:
                      AutoExecutor(clients, seed, threads=threads or 1))


register()
