"""Executors by name: the registry the round loop builds its executor from (``executor`` key / ``--executor``).

- ``sequential`` — one client after another in this process (the reference, ``engine/executor.py``);
- ``batched`` — clients of a declared program trained together with ``torch.func`` (``executors/batched.py``);
- ``stacked`` — ``batched`` with one batched matrix product per layer for linear models (``executors/stacked.py``);
- ``processes`` — a pool of worker processes (``executors/processes.py``);
- ``auto`` — a short probe picks one of the above (``executors/auto.py``);
- ``flower`` — Flower's simulation runtime, one message per job (``fedfuse/flower/``, ``pip install fedfuse[flower]``).

The engine registers only its reference, ``sequential``.  The executors above the engine are registered by the
composition root (:mod:`fedfuse.runner`) with :func:`register_executor`: ``batched``, ``stacked``, ``processes`` and
``auto``
when :mod:`fedfuse.executors` is imported, ``flower`` by the runner itself; the engine never imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fedfuse.engine.contract import Executor
from fedfuse.engine.executor import SequentialExecutor
from fedfuse.errors import UserError
from fedfuse.types import ClientData

#: ``factory(clients, seed, threads=..., config=...)``: ``threads`` is the run's ``threads`` key (0 = default),
#: ``config`` the run's resolved RunConfig (an executor whose nodes rebuild the run from it needs it).
ExecutorFactory = Callable[..., Executor]

_FACTORIES: dict[str, ExecutorFactory] = {
    "sequential": lambda clients, seed, threads=0, config=None: SequentialExecutor(clients, seed),
}
_ABOVE = ("executor {!r} is registered by fedfuse.runner (fedfuse.run, the fedfuse command); code that builds "
          "an Experiment itself registers it by importing fedfuse.executors")
#: executors a composition root may register, with what the user must do when one is missing
_KNOWN_ELSEWHERE = {
    "batched": _ABOVE.format("batched"),
    "stacked": _ABOVE.format("stacked"),
    "processes": _ABOVE.format("processes"),
    "auto": _ABOVE.format("auto"),
    "flower": "executor 'flower' is registered by fedfuse.runner (fedfuse.run, the fedfuse command); it needs "
              "Flower: pip install 'fedfuse[flower]'",
}


def register_executor(name: str, factory: ExecutorFactory) -> None:
    """Make ``name`` buildable by :func:`make_executor` (a later registration replaces an earlier one)."""
    _FACTORIES[name] = factory


def executor_names() -> tuple[str, ...]:
    """The registered executor names."""
    return tuple(_FACTORIES)


def make_executor(name: str, clients: Sequence[ClientData], seed: int, *, threads: int = 0,
                  config: Any = None) -> Executor:
    """The executor called ``name`` for ``clients``."""
    factory = _FACTORIES.get(name)
    if factory is None:
        if name in _KNOWN_ELSEWHERE:
            raise UserError(_KNOWN_ELSEWHERE[name])
        raise UserError(f"unknown executor {name!r}; choose one of: {', '.join(_FACTORIES)}")
    return factory(clients, seed, threads=threads, config=config)
