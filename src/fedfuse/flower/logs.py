"""A deployed run's progress in Flower's own tooling: ``flwr run --stream`` and ``flwr log [--stream]``.

A ServerApp's log reaches the ``flwr`` CLI only through Flower's logger: the ``flwr-serverapp`` process mirrors what
Flower's console handler writes into the run's log, which the SuperLink keeps and ``flwr log RUN_ID`` shows.  fedfuse
logs to its own ``fedfuse`` logger, which nothing prints inside ``flwr-serverapp``.  :func:`forward_to_flower` (the
ServerApp calls it) forwards the ``fedfuse`` logger's records at INFO and above to Flower's logger for the rest of
the process (:func:`flower_logging`: for a ``with`` block), and
:class:`RoundLog` writes one line per round (the round, its replies and dropouts, the training loss and the
evaluation's loss and accuracy when the round evaluated), e.g.::

    INFO :      fedfuse round 2/4: 2/2 replied, train_loss 0.7020, loss 1.1725, global_accuracy 0.6111
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

from fedfuse.engine.callbacks import Callback

log = logging.getLogger("fedfuse")

#: the record entries a round's line shows, in this order, when present (losses and accuracies of each evaluation)
SHOWN = ("train_loss", "loss", "global_loss", "global_accuracy", "personal_loss", "personal_accuracy", "val_loss",
         "val_accuracy", "perplexity")


def round_line(record: dict[str, Any], rounds: int | None = None) -> str:
    """One round's progress line: ``fedfuse round R/N: k/n replied[, d dropped], name value, ...`` (only the finite
    entries of :data:`SHOWN`; ``loss`` is left out where it repeats ``global_loss``)."""
    head = f"fedfuse round {record.get('round', '?')}" + (f"/{rounds}" if rounds else "")
    sampled = record.get("clients")
    parts = []
    if isinstance(sampled, list):
        parts.append(f"{record.get('replied', len(sampled))}/{len(sampled)} replied")
    dropped = record.get("dropped")
    if dropped:
        parts.append(f"{len(dropped)} dropped {sorted(dropped)}")
    if record.get("round_skipped"):
        parts.append("no update (round skipped)")
    for key in SHOWN:
        value = record.get(key)
        if key == "loss" and value is not None and value == record.get("global_loss"):
            continue
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            parts.append(f"{key} {value:.4f}")
    return head + (": " + ", ".join(parts) if parts else "")


class RoundLog(Callback):
    """Logs the run's start and every round (:func:`round_line`) at INFO on the ``fedfuse`` logger."""

    def __init__(self) -> None:
        self.rounds: int | None = None

    def on_run_start(self, config: Any) -> None:
        self.rounds = int(config.rounds)
        log.info("fedfuse run: %s, %d rounds, %s clients (%s per round), seed %s", config.algorithm, config.rounds,
                 config.clients, config.clients_per_round, config.seed)

    def on_round(self, record: dict[str, Any]) -> None:
        log.info("%s", round_line(record, self.rounds))


class ToFlower(logging.Handler):
    """Hands each record to Flower's logger (its console handler, which ``flwr-serverapp`` mirrors to the run's
    log), as a message of Flower's own format."""

    def emit(self, record: logging.LogRecord) -> None:
        from flwr.common.logger import FLOWER_LOGGER

        try:
            FLOWER_LOGGER.log(record.levelno, "%s", self.format(record))
        except Exception:  # a logging failure must not end the run
            self.handleError(record)


def forward_to_flower(level: int = logging.INFO) -> ToFlower:
    """For the rest of this process (a ``flwr-serverapp`` runs one ServerApp), the ``fedfuse`` logger's records at
    ``level`` and above also go to Flower's logger; calling it again adds no second handler."""
    for handler in log.handlers:
        if isinstance(handler, ToFlower):
            return handler
    handler = ToFlower(level)
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    log.addHandler(handler)
    return handler


@contextlib.contextmanager
def flower_logging(level: int = logging.INFO) -> Iterator[ToFlower]:
    """While active, the ``fedfuse`` logger's records at ``level`` and above also go to Flower's logger (so they
    show in ``flwr log``); the logger's level and handlers are restored afterwards."""
    handler = ToFlower(level)
    saved = log.level
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(saved)
