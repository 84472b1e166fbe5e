"""Simulated client faults: dropouts, stragglers and corrupted replies, on a seeded schedule.

Every draw comes from ``numpy_rng(seed, "faults", round, client)``, so the schedule depends only on the run's
seed, the round and the client: it is the same in every executor, in any client order, and after a resume.

* **Dropout** (``dropout = p``): a sampled client received its payload but fails to reply in that round.  It
  does no work, its persistent state is unchanged, and it takes no part in any later stage of the round.
* **Straggler** (``stragglers = p``, ``deadline = d``): a sampled client is slow with probability ``p``; its
  round takes ``1 + E`` times a normal client's time, ``E ~ Exponential(1)``.  When that exceeds the deadline
  ``d`` (in the same units) its reply arrives after the server closed the round: the client did its work (its
  own state advanced) but the server ignores the late reply.  With the default ``d = 2`` a straggler misses the
  round with probability ``exp(-(d - 1)) ≈ 0.37``.
* **Corrupted replies** (``corrupt``, ``corrupt_clients``) model faulty or malicious clients for robustness
  studies: the listed clients train normally and then send a reply whose tensors hold a NaN or an Inf, whose
  first multi-row tensor has a wrong shape that still broadcasts (``(1, ...)`` instead of ``(n, ...)``), whose
  update is scaled 1000x, which claims 10¹² examples, or which is lost on the way (``drop``, the reference
  "run without that client" for robustness tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedfuse.config import RunConfig
from fedfuse.rng import numpy_rng
from fedfuse.sections import FaultSettings
from fedfuse.types import SIM_PREFIX, FitStats, Message

OK, DROPOUT, LATE = "ok", "dropout", "late"
SCALE = 1000.0  # the "scale" corruption multiplies a client's update by this


@dataclass(frozen=True)
class FaultPlan:
    """The fault settings of a run; :meth:`fate` and :meth:`corrupt` apply them."""

    seed: int = 0
    dropout: float = 0.0
    stragglers: float = 0.0
    deadline: float = 2.0
    corrupt_mode: str = "none"
    corrupt_clients: tuple[int, ...] = ()

    @classmethod
    def from_settings(cls, seed: int, faults: FaultSettings) -> FaultPlan:
        """The plan of a run of ``seed`` with the run config's fault section ``faults`` (``cfg.faults``)."""
        return cls(int(seed), float(faults.dropout), float(faults.stragglers), float(faults.deadline),
                   str(faults.corrupt), tuple(int(c) for c in faults.corrupt_clients))

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FaultPlan:
        """The plan of a run config."""
        return cls.from_settings(cfg.seed, cfg.faults)

    def fate(self, round_index: int, cid: int) -> str:
        """``"ok"``, ``"dropout"`` (no reply) or ``"late"`` (reply after the deadline) for one client in one round."""
        if self.dropout <= 0 and self.stragglers <= 0:
            return OK
        u_drop, u_slow, u_time = numpy_rng(self.seed, "faults", round_index, cid).random(3)
        if u_drop < self.dropout:
            return DROPOUT
        if u_slow < self.stragglers:
            duration = 1.0 - math.log1p(-u_time)  # 1 + Exponential(1)
            if duration > self.deadline:
                return LATE
        return OK

    def fates(self, round_index: int, clients: list[int]) -> dict[int, str]:
        return {c: self.fate(round_index, c) for c in clients}

    def corrupts(self, cid: int) -> bool:
        return self.corrupt_mode != "none" and cid in self.corrupt_clients

    def corrupt(self, cid: int, sent: Message, reply: Message, state_like: bool) -> Message | None:
        """The reply a faulty client ``cid`` sends instead of ``reply`` (None: the reply is lost)."""
        if not self.corrupts(cid):
            return reply
        mode = self.corrupt_mode
        if mode == "drop":
            return None
        tensors = dict(reply.tensors)
        meta = dict(reply.meta)
        stats = reply.stats
        floats = [k for k, v in tensors.items() if v.is_floating_point() and v.numel()]
        if mode == "count":  # a copy: the honest reply's record stays as it was
            stats = dataclasses.replace(stats or FitStats(), num_examples=10**12)
        elif mode in ("nan", "inf") and floats:
            t = tensors[floats[0]].clone()
            t.view(-1)[0] = math.nan if mode == "nan" else math.inf
            tensors[floats[0]] = t
        elif mode == "shape":
            rows = [k for k in floats if tensors[k].dim() >= 1 and tensors[k].shape[0] > 1]
            if rows:
                tensors[rows[0]] = tensors[rows[0]][:1].clone()  # (1, ...) broadcasts against (n, ...)
        elif mode == "scale":
            base = reference_tensors(sent, reply, state_like)
            for k in floats:
                b = base.get(k)
                tensors[k] = tensors[k] * SCALE if b is None else b + SCALE * (tensors[k] - b)
        return Message(tensors, meta, stats)


def reference_tensors(sent: Message, reply: Message, state_like: bool) -> Mapping[str, torch.Tensor]:
    """What a reply's update is measured from: the sent tensors when replies are model states in the payload's
    space (FedAvg-style), nothing (the reply itself is the update) otherwise."""
    if not state_like:
        return {}
    return {k: v for k, v in sent.tensors.items()
            if k in reply.tensors and v.shape == reply.tensors[k].shape and v.is_floating_point()}


def update_norm(sent: Message, reply: Message, state_like: bool) -> float:
    """L2 norm of a reply's update over its floating tensors (simulation-only ``sim/`` relays included): the
    differences in the tensors' own precision, their norms in one fused call, combined in float64."""
    base = reference_tensors(sent, reply, state_like)
    diffs = [v - base[k] if k in base else v for k, v in reply.tensors.items() if v.is_floating_point()]
    if not diffs:
        return 0.0
    norms = torch.stack([n.to("cpu", torch.float64) for n in torch._foreach_norm(diffs)])
    return math.sqrt(float(torch.dot(norms, norms)))


__all__ = ["DROPOUT", "LATE", "OK", "SCALE", "SIM_PREFIX", "FaultPlan", "reference_tensors", "update_norm"]
