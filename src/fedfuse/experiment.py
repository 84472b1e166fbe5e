"""Runs with fedfuse's own algorithms: the engine's :class:`~fedfuse.engine.loop.Experiment` bound to the
algorithm registry.

The engine never imports ``fedfuse.algorithms`` (one-way layers, ``docs/design.md``): it resolves an algorithm
name through the ``algorithm_lookup`` its caller passes.  This module is that caller for fedfuse itself (the
api, the CLI, the reproductions, the tests); code that brings its own algorithms passes its own lookup to
:class:`fedfuse.engine.loop.Experiment`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedfuse.algorithms import get_algorithm
from fedfuse.config import RunConfig
from fedfuse.engine import loop
from fedfuse.engine.context import RunContext
from fedfuse.engine.loop import build_context, build_federation, load_checkpoint, strip_timing
from fedfuse.types import Federation


class Experiment(loop.Experiment):
    """The engine's Experiment with its algorithm from fedfuse's registry (or ``algorithm_lookup``)."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        fed: Federation | None = None,
        executor: Any | None = None,
        progress: bool = False,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        algorithm_lookup: loop.AlgorithmLookup | None = None,
    ) -> None:
        super().__init__(cfg, fed=fed, executor=executor, progress=progress, on_round=on_round,
                         algorithm_lookup=algorithm_lookup or get_algorithm)


def build_algorithm(cfg: RunConfig, ctx: RunContext, lookup: loop.AlgorithmLookup | None = None) -> Any:
    """:func:`fedfuse.engine.loop.build_algorithm` with fedfuse's registry as the default lookup."""
    return loop.build_algorithm(cfg, ctx, lookup or get_algorithm)


def run(cfg: RunConfig, *, resume: bool = False, progress: bool = False) -> dict[str, Any]:
    """Build an :class:`Experiment` and run it; returns the summary."""
    return Experiment(cfg, progress=progress).run(resume=resume)


__all__ = ["Experiment", "build_algorithm", "build_context", "build_federation", "load_checkpoint", "run",
           "strip_timing"]
