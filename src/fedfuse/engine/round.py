"""The bookkeeping of one round: what it collected, what crossed the wire, what the accepted replies did.

The round loop (:meth:`fedfuse.engine.loop.Experiment._round`) runs each stage of a round as four named steps —
**collect** (send the payloads, run the clients, apply faults, deliver late replies), **screen** (quarantine
replies the update checks reject), **account** (the accepted replies' local work) and **fuse** (quorum,
client-to-client exchange, the algorithm's server update) — and writes what each step finds into a
:class:`RoundLedger`, which becomes the round's metrics record and adds itself to the run's :class:`Totals`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfuse.types import SIM_PREFIX, Message


@dataclass
class Totals:
    """The run's running totals, which every round's ledger adds to (:meth:`RoundLedger.add_to`) and the
    checkpoint stores."""

    bytes_down: int = 0
    bytes_up: int = 0
    bytes_peer: int = 0
    client_flops: float = 0.0
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0  # the loop process's CPU time, all threads (NaN: resumed from a checkpoint without it)
    dropped: int = 0  # sampled clients that never replied
    late: int = 0  # replies that missed the deadline
    quarantined: int = 0  # replies rejected by the update checks
    skipped_rounds: int = 0  # rounds with fewer replies than the quorum


@dataclass
class Collected:
    """One stage's traffic: the payloads sent, the replies that arrived in time (late ones from an earlier round
    included) and, per reply, the payload it answers."""

    payloads: dict[int, Message]
    results: dict[int, Message]
    sent: dict[int, Message]


@dataclass
class RoundLedger:
    """Everything a round adds up, stage after stage."""

    clients: list[int]  # sampled
    dropped: list[int]  # sampled but never replied
    active: list[int]  # who takes part in the next stage: everyone sampled, then whoever replied
    late: list[int] = field(default_factory=list)  # worked, but the reply missed the deadline
    delivered_late: list[int] = field(default_factory=list)  # late replies of an earlier round used now
    quarantined: dict[str, str] = field(default_factory=dict)  # client -> why the update checks rejected it
    down: int = 0  # bytes sent to clients
    up: int = 0  # bytes received from clients
    peer: int = 0  # bytes clients sent each other (the algorithm's exchange)
    flops: float = 0.0
    comm_params: dict[int, int] = field(default_factory=dict)  # client -> parameters sent to it over all stages
    trained_params: list[int] = field(default_factory=list)
    loss_sum: float = 0.0  # Σ train_loss × samples over accepted replies
    samples: int = 0
    honest_replies: int = 0  # replies of clients the fault plan does not corrupt
    honest_bad: int = 0  # of those, quarantined as non-finite
    skipped: bool = False  # fewer replies than the quorum: the server state was left as it was

    @property
    def train_loss(self) -> float | None:
        return self.loss_sum / self.samples if self.samples else None

    def add_traffic(self, got: Collected) -> None:
        """Bytes down and up, and the parameters each client was sent (``sim/...`` bookkeeping is not traffic)."""
        self.down += sum(p.nbytes for p in got.payloads.values())
        self.up += sum(res.nbytes for res in got.results.values())
        for c, p in got.payloads.items():
            self.comm_params[c] = self.comm_params.get(c, 0) + sum(t.numel() for k, t in p.tensors.items()
                                                                   if not k.startswith(SIM_PREFIX))

    def add_work(self, results: dict[int, Message]) -> None:
        """The local work the accepted replies report (FLOPs, trained parameters, sample-weighted loss)."""
        for res in results.values():
            st = res.stats
            if st is None:  # a reply that reports no local work (e.g. a relayed peer envelope)
                continue
            self.flops += st.flops
            if st.trained_params is not None:  # stages without training (e.g. BN statistics) do not count
                self.trained_params.append(st.trained_params)
            self.loss_sum += st.train_loss * st.samples
            self.samples += st.samples

    def add_to(self, totals: Totals) -> None:
        """Add this round to the run's running totals."""
        totals.bytes_down += self.down
        totals.bytes_up += self.up
        totals.bytes_peer += self.peer
        totals.client_flops += self.flops
        totals.dropped += len(self.dropped)
        totals.late += len(self.late)
        totals.quarantined += len(self.quarantined)
        totals.skipped_rounds += int(self.skipped)

    def record(self, r: int, totals: Totals, server_parameters: int) -> dict[str, Any]:
        """The round's metrics record (before evaluation), with the running totals after it."""
        return {
            "round": r + 1,
            "clients": self.clients,
            "replied": len(self.active),
            "dropped": self.dropped,
            "late": sorted(set(self.late)),
            "delivered_late": self.delivered_late,
            "quarantined": self.quarantined,
            "round_skipped": self.skipped,
            "train_loss": self.train_loss,
            "bytes_down": self.down,
            "bytes_up": self.up,
            "bytes_peer": self.peer,
            "client_flops": self.flops,
            "total_bytes_down": totals.bytes_down,
            "total_bytes_up": totals.bytes_up,
            "total_bytes_peer": totals.bytes_peer,
            "total_client_flops": totals.client_flops,
            "server_parameters": server_parameters,
            "communicated_parameters_per_client": (float(np.mean(list(self.comm_params.values())))
                                                   if self.comm_params else 0.0),
            "optimised_parameters_per_client": float(np.mean(self.trained_params)) if self.trained_params else 0.0,
            "total_dropped": totals.dropped,
            "total_late": totals.late,
            "total_quarantined": totals.quarantined,
        }
