"""The composition root: where fedfuse's layers are wired into a run.

The engine (:mod:`fedfuse.engine.loop`) knows no algorithm, no executor above it and no output file for humans.
This module binds them for fedfuse's own entry points (:mod:`fedfuse.api`, the command line, sweeps, the
reproductions):

- the algorithm: the class registered under ``cfg.algorithm`` (:func:`fedfuse.algorithms.get_algorithm`);
- the executors above the engine's sequential reference, registered with the engine's executor registry when
  this module is imported: ``batched``, ``processes`` and ``auto`` (:mod:`fedfuse.executors`) and ``flower``
  (Flower's simulation runtime);
- the run directory's partition files and curves (:mod:`fedfuse.outputs`), as callbacks.

Code that brings its own algorithm builds :class:`fedfuse.engine.loop.Experiment` with the class directly.
"""

from __future__ import annotations

import datetime
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedfuse.algorithms import get_algorithm
from fedfuse.config import RunConfig, check_extras
from fedfuse.engine.callbacks import Callback, make_loggers
from fedfuse.engine.executors import register_executor
from fedfuse.engine.loop import Experiment
from fedfuse.errors import BUG, DivergenceError, UserError
from fedfuse.executors import register as register_executors
from fedfuse.extras import require_extra
from fedfuse.outputs import output_callbacks
from fedfuse.result import Result
from fedfuse.runfiles import LOG
from fedfuse.types import ClientData, Federation


def _flower_executor(clients: Sequence[ClientData], seed: int, *, threads: int = 0, config: Any = None) -> Any:
    """``--executor flower``: the nodes rebuild the run from ``config``."""
    require_extra("flower", "executor 'flower'")
    from fedfuse.flower.simulation import SimulationExecutor

    if config is None:
        raise TypeError("executor 'flower' needs the run's config")
    return SimulationExecutor(config, seed, num_nodes=len(clients), threads=threads or 1)


register_executors()  # batched, processes, auto
register_executor("flower", _flower_executor)



def experiment(cfg: RunConfig, *, fed: Federation | None = None, executor: Any | None = None,
               progress: bool = False, on_round: Callable[[dict[str, Any]], None] | None = None,
               callbacks: Sequence[Callback] = ()) -> Experiment:
    """The :class:`~fedfuse.engine.loop.Experiment` of ``cfg`` with fedfuse's algorithm of that name, writing the
    run directory's partition files and curves (when ``out`` and ``plots`` are set)."""
    exp = Experiment(cfg, get_algorithm(cfg.algorithm), fed=fed, executor=executor, progress=progress,
                     on_round=on_round, callbacks=callbacks)
    exp.attach(*output_callbacks(exp.fed))
    return exp


def execute(cfg: RunConfig, *, progress: bool = False, callbacks: Sequence[Callback] = (),
            log: Sequence[str] = (), resume: bool = False, fed: Federation | None = None) -> Result:
    """Run ``cfg`` (a resolved config) with the given callbacks and built-in loggers; returns its :class:`Result`.
    A missing extra (:func:`fedfuse.config.check_extras`) is raised before any work; a bug in fedfuse leaves its
    traceback in the run's log (:func:`bugs_logged`)."""
    check_extras(cfg)
    with bugs_logged(cfg):
        exp = experiment(cfg, fed=fed, progress=progress, callbacks=[*callbacks, *make_loggers(log, cfg)])
        summary = exp.run(resume=resume)
    return Result(exp.cfg, exp.history, summary, exp.out)


@contextmanager
def bugs_logged(cfg: RunConfig) -> Iterator[None]:
    """An internal error raised inside (anything but a user error, a divergence or an interruption: a bug in
    fedfuse) is written with its traceback to the run's log, ``fedfuse.log`` in ``cfg.out``, and re-raised with
    a note naming that file."""
    try:
        yield
    except (UserError, DivergenceError):
        raise
    except Exception as e:
        path = log_internal_error(cfg, e)
        if path is not None:
            e.add_note(f"traceback in {path}")
        raise


def log_internal_error(cfg: RunConfig, e: BaseException) -> Path | None:
    """Append ``e`` and its traceback to ``fedfuse.log`` in the run directory (None when the run writes no
    files or the log cannot be written)."""
    if not cfg.out:
        return None
    path = Path(cfg.out) / LOG
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            f.write(f"{stamp} run {cfg.algorithm} on {cfg.dataset}, seed {cfg.seed}: {BUG}\n")
            f.write("".join(traceback.format_exception(e)))
    except OSError:
        return None
    return path


def run(cfg: RunConfig, *, resume: bool = False, progress: bool = False,
        fed: Federation | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Build the :func:`experiment` of ``cfg`` and run it (bugs logged as by :func:`execute`); returns the
    summary and the per-round records."""
    check_extras(cfg)
    with bugs_logged(cfg):
        exp = experiment(cfg, fed=fed, progress=progress)
        summary = exp.run(resume=resume)
    return summary, exp.history
