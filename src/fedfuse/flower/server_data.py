"""A deployed server without data: what it learns from the nodes, and what it checks.

A deployed fedfuse server (the ServerApp, :mod:`fedfuse.flower.app`) with ``global_eval`` ``federated`` or
``none`` opens no dataset file.  It asks the nodes which clients they hold (the ``query`` message of
:class:`~fedfuse.flower.executor.FlowerExecutor`); each node answers with its clients' ids, their training-set
sizes and the shape of its data (task, classes, input shape: a node bundle's metadata).  From the answers the
server builds a :class:`~fedfuse.types.Federation` without data (:func:`dataless_federation`: empty splits, the
reported sizes), which is all a server rule needs — the clients' sizes weigh the aggregation and the sampling,
the data's shape builds the model.  The global model is evaluated by the clients (federated evaluation,
:mod:`fedfuse.engine.federated_eval`).  With ``global_eval=server`` the operator gives the server a dataset (its
``data_dir``) for the global test set, and the nodes' answers are checked against it.

Claims are checked, not trusted (:class:`ClaimCheck`): a node reporting a client outside the run, a size other
than the one the federation already has for that client (another export's bundle, or a device rejoining with
another client's data), or data of another shape than the other nodes' is refused and its clients are not
served; two nodes claiming one client are refused by the executor.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedfuse.errors import UserError
from fedfuse.types import ClientData, Federation, Split

log = logging.getLogger("fedfuse")

#: what a node reports of its data beside the clients' sizes (all nodes of a run must agree)
DATA_KEYS = ("task", "num_classes", "input_shape")


def node_answer(fed: Federation, held: Sequence[int] | None) -> dict[str, str]:
    """A node's answer beside its client ids (JSON strings, as Flower's ``ConfigRecord`` carries them): the
    training-set size of each client it serves (``held``; None: every client) and the shape of its data."""
    ids = range(fed.num_clients) if held is None else held
    sizes = fed.client_sizes()
    data = {"task": fed.task, "num_classes": int(fed.num_classes), "input_shape": [int(s) for s in fed.input_shape],
            "dataset": fed.dataset, "class_names": fed.class_names}
    return {"sizes": json.dumps({str(int(c)): int(sizes[int(c)]) for c in ids}), "data": json.dumps(data)}


class ClaimCheck:
    """Checks each node's answer (``executor.vet``) and collects what the answers establish: every client's
    size and the data's shape.  The first accepted claim of a client fixes its size (``sizes`` given: the
    server's own federation fixes them all); a later claim must agree.  A refused node's clients are not served
    (they count as absent) and the node is asked again on the executor's next call."""

    def __init__(self, num_clients: int, sizes: Sequence[int] | np.ndarray | None = None) -> None:
        self.num_clients = num_clients
        self.sizes: dict[int, int] = {} if sizes is None else {c: int(n) for c, n in enumerate(sizes)}
        self.data: dict[str, Any] | None = None
        self.shape_of: int | None = None  # the node whose answer fixed ``data``
        self.extra: dict[str, Any] = {}  # the dataset's name and class names, as that node gave them

    def __call__(self, node: int, held: Any, answer: Mapping[str, Any]) -> str | None:
        """None if ``node``'s answer (``held``: its client ids or ``"*"``; ``answer``: :func:`node_answer`'s
        entries, decoded) is consistent with the run and the earlier answers (and then recorded), else why not."""
        if "sizes" not in answer or "data" not in answer:
            return "its answer carries no client sizes (a fedfuse older than the server's?)"
        sizes = {int(c): n for c, n in dict(answer["sizes"]).items()}
        ids = list(range(self.num_clients)) if held == "*" else [int(c) for c in held]
        why = self._unsized(ids, sizes)
        if why:
            return why
        differ = [f"client {c}: {sizes[c]} examples (the federation's: {self.sizes[c]})" for c in ids
                  if c in self.sizes and sizes[c] != self.sizes[c]]
        if differ:
            return f"its clients' sizes differ from the federation's ({'; '.join(differ)}): not this run's data"
        data = {k: answer["data"].get(k) for k in DATA_KEYS}
        if self.data is not None and data != self.data:
            return f"its data is {data}, node {self.shape_of}'s is {self.data}"
        if self.data is None:
            self.data, self.shape_of = data, node
            self.extra = {k: answer["data"].get(k) for k in ("dataset", "class_names")}
        for c in ids:
            self.sizes.setdefault(c, sizes[c])
        return None

    def _unsized(self, ids: list[int], sizes: Mapping[int, Any]) -> str | None:
        """Why the claimed clients ``ids`` with their ``sizes`` are not well formed (None: they are)."""
        outside = sorted(c for c in ids if not 0 <= c < self.num_clients)
        if outside:
            return f"it claims clients {outside}, but the run has clients 0..{self.num_clients - 1}"
        unsized = sorted(c for c in ids if c not in sizes)
        if unsized:
            return f"it gives no size for clients {unsized}"
        bad = sorted(c for c in ids if not isinstance(sizes[c], int) or sizes[c] < 0)
        if bad:
            return f"it reports invalid sizes for clients {bad}: {[sizes[c] for c in bad]}"
        return None

    def missing(self) -> list[int]:
        """The clients no accepted answer has given a size for yet."""
        return [c for c in range(self.num_clients) if c not in self.sizes]


def dataless_federation(cfg: Any, sizes: Mapping[int, int], data: Mapping[str, Any],
                        extra: Mapping[str, Any] | None = None) -> Federation:
    """The federation of run ``cfg`` as a server without data knows it: ``cfg.clients`` clients whose splits (and
    the global test set) are empty, their training-set ``sizes`` and the data's shape (``data``: task, classes,
    input shape; ``extra``: dataset name and class names, informative)."""
    shape = tuple(int(s) for s in data["input_shape"])
    lm = data["task"] == "lm"
    empty = Split(torch.empty((0, *shape), dtype=torch.long if lm else torch.float32),
                  torch.empty((0, *shape) if lm else (0,), dtype=torch.long))
    extra = dict(extra or {})
    return Federation(clients=[ClientData(c, empty, empty, empty) for c in range(cfg.clients)], test=empty,
                      num_classes=int(data["num_classes"]), input_shape=shape, task=data["task"],
                      dataset=str(extra.get("dataset") or cfg.dataset), partition=cfg.partition,
                      class_names=extra.get("class_names"), info={"server_data": "none (sizes from the nodes)"},
                      sizes=np.array([int(sizes[c]) for c in range(cfg.clients)], dtype=np.int64))


def learn_federation(executor: Any, cfg: Any, *, wait: float | None = None, poll: float = 1.0) -> Federation:
    """The federation of run ``cfg`` learnt from the nodes of ``executor`` (a
    :class:`~fedfuse.flower.executor.FlowerExecutor`, whose ``vet`` becomes a :class:`ClaimCheck`): it waits up to
    ``wait`` seconds (default: the executor's ``node_wait``) until the connected nodes' answers give every
    client's size, and raises :class:`~fedfuse.errors.UserError` naming the clients nobody gave."""
    check = ClaimCheck(cfg.clients)
    executor.vet = check
    wait = float(executor.node_wait if wait is None else wait)
    deadline = time.monotonic() + wait
    while True:
        executor.discover(executor.nodes())
        missing = check.missing()
        if not missing and check.data is not None:
            break
        if time.monotonic() > deadline:
            raise UserError(f"the server holds no data and learns each client's size from the node holding it, but "
                            f"no connected node holds clients {missing} (after {wait:.0f} s): start the devices that "
                            "hold them, or give the server its dataset with global_eval=server")
        time.sleep(poll)
    log.info("flower: the server holds no data; the %d clients' sizes from the nodes: %s", cfg.clients,
             [check.sizes[c] for c in range(cfg.clients)])
    return dataless_federation(cfg, check.sizes, check.data, check.extra)


def record_opens(path: str) -> None:
    """Append every path this process opens from now on to the file ``path`` (a Python audit hook; the
    deployment tests read it to show the server opens no data file)."""
    sink = open(path, "a", buffering=1)  # noqa: SIM115  (open for the life of the process)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
            sink.write(os.fsdecode(args[0]) + "\n")

    sys.addaudithook(hook)


__all__ = ["DATA_KEYS", "ClaimCheck", "dataless_federation", "learn_federation", "node_answer", "record_opens"]
