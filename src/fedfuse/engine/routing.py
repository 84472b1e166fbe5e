"""Which executor actually trained the clients, and why a request was re-routed.

An executor may hand some clients to a simpler path than its own: ``stacked`` trains a model without a stacked
forward pass (convolutions, norms, attention) with ``batched``'s ``vmap`` step, and ``batched`` trains an
algorithm without a declared client program, a model with dropout or a group ``vmap`` cannot run one client at
a time (``sequential``).  Results stay correct either way; what changes is the speed and, between the batched
paths and the sequential one, the floating-point summation order.  So every executor writes down, per client
training, the path that ran it and why it left the executor's own path (:class:`RouteLog`), and the run's
summary says what was asked for and what ran (:func:`executor_summary`)::

    "executor": {"requested": "stacked", "used": "batched",
                 "reason": "CNN: no stacked forward pass (120 of 120 client trainings ran batched)",
                 "clients": {"batched": 120}, "detail": "stacked"}

``clients`` counts client trainings (one per sampled client per round) by path; ``detail`` is the executor's own
description (``auto→batched``, ``processes(2×1 threads)``), which a checkpoint records to resume with the same
choice.  Evaluation is not counted: every in-process executor evaluates one client after another.
"""

from __future__ import annotations

from typing import Any


class RouteLog:
    """Client trainings by (path, reason): ``reason`` is ``None`` on the executor's own path."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str | None], int] = {}
        self.choice: str | None = None  # why an executor that chooses (auto) chose its path

    def ran(self, path: str, n: int = 1, reason: str | None = None) -> None:
        """``n`` client trainings ran on ``path`` (``reason``: why not on the executor's own path)."""
        if n > 0:
            self.counts[path, reason] = self.counts.get((path, reason), 0) + n

    def paths(self) -> dict[str, int]:
        """Client trainings per path, the most used first."""
        out: dict[str, int] = {}
        for (path, _), n in self.counts.items():
            out[path] = out.get(path, 0) + n
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def rerouted(self) -> dict[tuple[str, str], int]:
        """(path, reason) → client trainings that left the executor's own path, the most frequent first."""
        moved = {(p, r): n for (p, r), n in self.counts.items() if r is not None}
        return dict(sorted(moved.items(), key=lambda kv: (-kv[1], kv[0])))

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint: a resumed run's summary counts the rounds before the interruption too."""
        return {"counts": [[p, r, n] for (p, r), n in self.counts.items()], "choice": self.choice}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.counts = {(p, r): int(n) for p, r, n in state.get("counts", [])}
        self.choice = state.get("choice", self.choice)


def executor_summary(requested: str, log: RouteLog, detail: str) -> dict[str, Any]:
    """The summary's ``executor`` block: ``requested`` (the run's ``executor`` key), ``used`` (the paths that
    trained clients, most used first, joined by ``+``; ``detail`` before any training), ``reason`` (why the
    request was re-routed, ``None`` when it was not), ``clients`` (client trainings per path) and ``detail``."""
    paths = log.paths()
    total = sum(paths.values())
    reasons = [f"{reason} ({n} of {total} client trainings ran {path})"
               for (path, reason), n in log.rerouted().items()]
    if log.choice:
        reasons.insert(0, log.choice)
    return {"requested": requested, "used": "+".join(paths) or detail, "reason": "; ".join(reasons) or None,
            "clients": paths, "detail": detail}


def executor_line(block: dict[str, Any] | str | None) -> str | None:
    """The one line a run prints about its executor: ``executor: batched``, or what ran instead of what was
    asked for and why (``executor: batched instead of the requested stacked: CNN: no stacked forward pass (4 of
    4 client trainings ran batched)``).  A summary written before the block existed holds the executor's name;
    ``None`` without either."""
    if not isinstance(block, dict):
        return f"executor: {block}" if block else None
    used, requested, reason = block.get("used"), block.get("requested"), block.get("reason")
    if not reason:
        return f"executor: {used}"
    if requested == "auto":
        return f"executor: {used}, chosen by auto: {reason}"
    return f"executor: {used} instead of the requested {requested}: {reason}"
